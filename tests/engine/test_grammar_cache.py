"""The engine's compiled-grammar cache and compile pool (structured.py): bounded by entries and
bytes (least recently used dropped first), compiles shared and off the caller's thread, a busy
pool refused with 503, a slow compile a 503 with retry_after (and cached for the retry), a bad
grammar a 400; the SmolLM2 vocabulary, real xgrammar compiles."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from flotilla.libs.common.messages import GuidedDecoding
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.structured import GrammarCompileTimeout, StructuredOutputs
from flotilla.services.tokenizer.tokenizer import Tokenizer


def _schema(i: int) -> GuidedDecoding:
    schema = {"type": "object", "required": [f"field_{i}"], "additionalProperties": False,
              "properties": {f"field_{i}": {"type": "string", "maxLength": 8}}}
    return GuidedDecoding(kind="json_schema", value=json.dumps(schema))


def _outputs(path: Path, tok: Tokenizer, **kw: object) -> StructuredOutputs:
    return StructuredOutputs(str(path), tok.vocab_size, tok.end_of_generation_ids(),
                             **kw)  # type: ignore[arg-type]


def test_the_cache_keeps_the_most_recently_used_within_its_entry_bound(
        smollm2_path: Path, smollm2: Tokenizer) -> None:
    outputs = _outputs(smollm2_path, smollm2, cache_max_entries=3)
    first = outputs.compile(_schema(0))
    one = outputs.compile(_schema(1))
    outputs.compile(_schema(2))
    assert outputs.compile(_schema(0)) is first  # a hit refreshes it
    outputs.compile(_schema(3))  # evicts 1, the least recently used
    assert outputs.cache_entries == 3
    assert outputs.compile(_schema(0)) is first
    assert outputs.compile(_schema(2)) is outputs.compile(_schema(2))
    assert outputs.compile(_schema(1)) is not one  # 1 was evicted: compiled again
    assert outputs.cache_entries == 3
    outputs.shutdown()


def test_the_cache_holds_at_most_its_bytes(smollm2_path: Path, smollm2: Tokenizer) -> None:
    outputs = _outputs(smollm2_path, smollm2, cache_max_bytes=1)
    one = outputs.compile(_schema(0))
    assert one.memory_size_bytes > 1
    for i in range(1, 12):
        outputs.compile(_schema(i))
        assert outputs.cache_entries <= 1 and outputs.cache_bytes <= one.memory_size_bytes * 4
    limit = 3 * one.memory_size_bytes
    outputs = _outputs(smollm2_path, smollm2, cache_max_bytes=limit)
    for i in range(20):
        outputs.compile(_schema(i))
        assert outputs.cache_bytes <= limit
    assert 1 < outputs.cache_entries < 20


def test_a_bad_grammar_is_a_400(smollm2_path: Path, smollm2: Tokenizer) -> None:
    outputs = _outputs(smollm2_path, smollm2)
    with pytest.raises(RequestError) as err:
        outputs.compile(GuidedDecoding(kind="grammar", value="root ::= ("))
    assert err.value.status == 400 and err.value.code == "invalid_grammar"
    assert outputs.cache_entries == 0


def test_a_busy_pool_and_a_slow_compile_are_503s_and_the_slow_compile_is_kept(
        smollm2_path: Path, smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = _outputs(smollm2_path, smollm2, compile_workers=1, max_pending=2)
    outputs.compile(_schema(100))  # the vocabulary loaded: what follows times compiles only
    release = threading.Event()
    real = outputs._compile

    def slow(spec: GuidedDecoding, key: tuple) -> object:  # type: ignore[type-arg]
        release.wait(10)
        return real(spec, key)

    monkeypatch.setattr(outputs, "_compile", slow)
    t0 = time.monotonic()
    with pytest.raises(GrammarCompileTimeout) as err:
        outputs.compile(_schema(1), timeout_s=0.2)
    assert time.monotonic() - t0 < 2 and err.value.status == 503
    assert err.value.retry_after_s == 0.2 and err.value.code == "grammar_compile_timeout"
    shared = outputs.compile_async(_schema(1))  # the same spec: the same compile
    outputs.compile_async(_schema(2))
    with pytest.raises(RequestError) as busy:
        outputs.compile_async(_schema(3))
    assert busy.value.status == 503 and busy.value.code == "grammar_compiler_busy"
    release.set()
    compiled = shared.result(timeout=30)
    assert outputs.compile(_schema(1)) is compiled  # the retry finds it cached
    outputs.shutdown()
