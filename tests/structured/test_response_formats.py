"""Every internal `response_format` kind becomes the engine's GuidedDecoding
(services/tokenizer/response_formats.py, gbnf.py): regex, choice, GBNF / EBNF grammars (llama.cpp's
own grammar files as the corpus), structural tags in both forms; bad specs are 400s naming them;
and what the engine samples under each (random logits) is what the spec promised, read back
with independent readers (re, json, jsonschema)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from xgrammar.testing import _is_grammar_accept_string

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import GuidedDecoding, TextRequest
from flotilla.libs.common.model_cache import cache_dir
from flotilla.services.engine.structured import StructuredOutputs
from flotilla.services.tokenizer.gbnf import GrammarError, to_xgrammar_ebnf
from flotilla.services.tokenizer.guided import grammar_of, guided_spec
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.tool_formats import HERMES
from tests.structured.test_constrained_sampling import generate
from tests.tokenizer.conftest import _llama_cpp_sdist_members


def spec_for(response_format: dict[str, Any],
             specials: frozenset[str] = frozenset()) -> GuidedDecoding:
    req = TextRequest(request_id="r", model="m", kind="completion", prompt="x",
                      stream_subject="s", response_format=response_format)
    spec = guided_spec(req, HERMES, special_texts=specials)
    assert spec is not None
    return spec


def accepts(spec: GuidedDecoding, text: str) -> bool:
    return _is_grammar_accept_string(grammar_of(spec), text)


def sampled(outputs: StructuredOutputs, tok: Tokenizer, spec: GuidedDecoding,
            seeds: int = 4) -> list[str]:
    texts = []
    for seed in range(seeds):
        ids, stopped = generate(outputs, tok, spec, seed, max_tokens=40)
        if stopped:
            texts.append(tok.decode(ids))
    assert texts  # random logits may wander; most finish in time
    return texts


def test_regex(outputs: StructuredOutputs, smollm2: Tokenizer) -> None:
    pattern = r"(cat|dog)-[0-9]{2,4}"
    spec = spec_for({"type": "regex", "regex": pattern})
    assert spec.kind == "regex"
    assert accepts(spec, "dog-123") and not accepts(spec, "cow-12")
    for text in sampled(outputs, smollm2, spec):
        assert re.fullmatch(pattern, text), text


def test_choice_escapes_every_character(outputs: StructuredOutputs,
                                        smollm2: Tokenizer) -> None:
    choices = ['say "yes"', "back\\slash", "new\nline", "tab\there", "émoji 🙂", "", "yes"]
    spec = spec_for({"type": "choice", "choice": choices})
    for choice in choices:
        assert accepts(spec, choice), choice
    assert not accepts(spec, "say yes") and not accepts(spec, "yes!")
    for text in sampled(outputs, smollm2, spec):
        assert text in choices


def test_a_choice_naming_a_control_token_may_generate_it(smollm2: Tokenizer) -> None:
    specials = frozenset({"<|im_end|>", "<|im_start|>"})
    spec = spec_for({"type": "choice", "choice": ["done<|im_end|>", "more"]}, specials)
    assert spec.special_tokens == ["<|im_end|>"]


@pytest.fixture(scope="module")
def gbnf_corpus() -> list[Path]:
    """llama.cpp's own GBNF grammars (grammars/*.gbnf), from the llama-cpp-python sdist."""
    folder = _llama_cpp_sdist_members(cache_dir() / "llama-cpp-grammars",
                                      "vendor/llama.cpp/grammars/", "GBNF grammars")
    return sorted(folder.glob("*.gbnf"))


def test_llama_cpp_grammars_all_compile(gbnf_corpus: list[Path]) -> None:
    assert len(gbnf_corpus) >= 5
    for path in gbnf_corpus:
        spec = spec_for({"type": "grammar", "grammar": path.read_text()})
        assert spec.kind == "grammar"
    json_gbnf = next(p for p in gbnf_corpus if p.name == "json.gbnf")
    spec = spec_for({"type": "grammar", "grammar": json_gbnf.read_text()})
    assert accepts(spec, '{"a": [1, 2.5, "x"]}') and not accepts(spec, "{a}")


def test_gbnf_features_xgrammar_lacks_are_converted(outputs: StructuredOutputs,
                                                   smollm2: Tokenizer) -> None:
    grammar = ('root ::= item ("," ws item){0,2}\n'
               'item ::= [a-c]{1,3} | "x" .\n'
               'ws ::= | " "   # an empty alternative, as GBNF allows\n')
    spec = spec_for({"type": "grammar", "grammar": grammar})
    assert accepts(spec, "ab, c,xz") and not accepts(spec, "ab,,c")
    reader = re.compile(r"([a-c]{1,3}|x.)(, ?([a-c]{1,3}|x.)){0,2}", re.DOTALL)
    for text in sampled(outputs, smollm2, spec):
        assert reader.fullmatch(text), text
    assert to_xgrammar_ebnf('root ::= "a"{,2}') == 'root ::= "a"{0,2}'


@pytest.mark.parametrize("grammar,param_word", [
    ("root ::= <think> [a-z]+ </think>", "token"),
    ("root ::= <[1000]> \"x\"", "token"),
    ("root ::= !<[1000]>*", "token"),
    ("root ::= undefined-rule", "cannot be used"),
    ("item ::= \"x\"", "cannot be used"),
])
def test_bad_grammars_are_400s(grammar: str, param_word: str) -> None:
    with pytest.raises(FlotillaError) as err:
        spec_for({"type": "grammar", "grammar": grammar})
    info = err.value.info
    assert info.status == 400 and info.param == "response_format.grammar"
    assert param_word in info.message
    if param_word == "token":
        with pytest.raises(GrammarError):
            to_xgrammar_ebnf(grammar)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
          "required": ["city"], "additionalProperties": False}


def test_structural_tags_in_both_forms(outputs: StructuredOutputs, smollm2: Tokenizer) -> None:
    current = {"format": {"type": "tag", "begin": "<call>",
                          "content": {"type": "json_schema", "json_schema": SCHEMA},
                          "end": "</call>"}}
    spec = spec_for({"type": "structural_tag", "structural_tag": current})
    assert accepts(spec, '<call>{"city": "Oslo"}</call>')
    assert not accepts(spec, '<call>{"town": "Oslo"}</call>')
    for text in sampled(outputs, smollm2, spec):
        assert text.startswith("<call>") and text.endswith("</call>")
        jsonschema.validate(json.loads(text[len("<call>"):-len("</call>")]), SCHEMA)
    older = {"type": "structural_tag", "structures": [
        {"begin": "<call>", "schema": SCHEMA, "end": "</call>"}], "triggers": ["<call>"]}
    spec = spec_for({"type": "structural_tag", "structural_tag": older})
    assert accepts(spec, 'Let me check. <call>{"city": "Oslo"}</call> Done.')
    assert not accepts(spec, 'Let me check. <call>{"city": 5}</call>')


@pytest.mark.parametrize("response_format,param", [
    ({"type": "regex", "regex": ""}, "response_format.regex"),
    ({"type": "regex", "regex": "(?=a)a"}, "response_format.regex"),
    ({"type": "choice", "choice": []}, "response_format.choice"),
    ({"type": "choice", "choice": ["a", 1]}, "response_format.choice"),
    ({"type": "structural_tag", "structural_tag": {"format": {
        "type": "json_schema", "json_schema": {"not": {}}}}},
     "response_format.structural_tag.format.json_schema.not"),
    ({"type": "structural_tag", "structural_tag": {"nope": 1}}, "response_format.structural_tag"),
    ({"type": "xml"}, "response_format.type"),
])
def test_bad_specs_are_400s_naming_them(response_format: dict[str, Any], param: str) -> None:
    with pytest.raises(FlotillaError) as err:
        spec_for(response_format)
    assert err.value.info.status == 400 and err.value.info.param == param, err.value.info
