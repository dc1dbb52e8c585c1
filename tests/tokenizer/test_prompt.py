"""Completions prompts, the context-length limit and the engine's sampling options."""

from __future__ import annotations

import pytest

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import SamplingOptions, TextRequest
from flotilla.services.tokenizer.prompt import PromptBuilder
from flotilla.services.tokenizer.service import resolve_max_model_len
from flotilla.services.tokenizer.tokenizer import Tokenizer


def completion(prompt: str | list[int], **kw: object) -> TextRequest:
    return TextRequest(request_id="r", model="m", kind="completion", prompt=prompt,
                       stream_subject="s", **kw)  # type: ignore[arg-type]


def test_context_length_exceeded_names_both_numbers(smollm2: Tokenizer) -> None:
    b = PromptBuilder(smollm2, max_model_len=64)
    req = completion("word" + " word" * 39, sampling=SamplingOptions(max_tokens=30))
    prompt_tokens = len(b.prepare(req).token_ids)
    assert prompt_tokens == 40
    with pytest.raises(FlotillaError) as err:
        b.sampling(req, prompt_tokens)
    info = err.value.info
    assert (info.status, info.code, info.param) == (400, "context_length_exceeded", "max_tokens")
    assert "maximum context length is 64 tokens" in info.message
    assert "70 tokens (40 in the prompt, 30 in the completion)" in info.message
    assert "max_tokens may be at most 24" in info.message


def test_prompt_alone_too_long_for_any_completion(smollm2: Tokenizer) -> None:
    b = PromptBuilder(smollm2, max_model_len=16)
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=[{"role": "user", "content": "hello " * 20}])
    n = len(b.prepare(req).token_ids)
    with pytest.raises(FlotillaError) as err:
        b.sampling(req, n)
    assert err.value.info.code == "context_length_exceeded"
    assert err.value.info.param == "messages"
    message = err.value.info.message
    assert f"resulted in {n} tokens" in message and "16 tokens" in message


def test_max_tokens_goes_to_the_engine_as_it_came(smollm2: Tokenizer) -> None:
    """The engine resolves an unset max_tokens against its own context (libs/common/context.py);
    the tokenizer only checks that the request fits."""
    b = PromptBuilder(smollm2, max_model_len=100)
    assert b.sampling(completion("hi"), prompt_tokens=30).max_tokens is None
    exact = completion("hi", sampling=SamplingOptions(max_tokens=70))
    assert b.sampling(exact, 30).max_tokens == 70


def test_end_of_turn_ids_go_to_the_engine(smollm2: Tokenizer) -> None:
    b = PromptBuilder(smollm2, max_model_len=100)
    im_end = smollm2.encode("<|im_end|>", add_special_tokens=False)[0]
    stop_ids = b.sampling(completion("hi", sampling=SamplingOptions(stop_token_ids=[7])), 1)
    assert stop_ids.stop_token_ids[0] == 7 and im_end in stop_ids.stop_token_ids
    ignore = b.sampling(completion("hi", sampling=SamplingOptions(ignore_eos=True)), 1)
    assert ignore.stop_token_ids == []


def test_max_model_len_is_capped_by_settings() -> None:
    assert resolve_max_model_len(8192, None) == 8192
    assert resolve_max_model_len(8192, 1024) == 1024
    assert resolve_max_model_len(None, 512) == 512
    with pytest.raises(ValueError, match="MAX_MODEL_LEN"):
        resolve_max_model_len(None, None)


def test_completion_prompts(smollm2: Tokenizer, hf_reference) -> None:
    b = PromptBuilder(smollm2, max_model_len=100)
    p = b.prepare(completion("Once upon a time", echo=True))
    assert p.token_ids == hf_reference.encode("Once upon a time")
    assert p.echo == "Once upon a time"
    ids = hf_reference.encode("<|im_start|>user\nhey")
    p = b.prepare(completion(ids, echo=True))
    assert p.token_ids == ids and p.echo == "<|im_start|>user\nhey"
    assert b.prepare(completion(ids)).echo == ""
    for bad in ([smollm2.vocab_size], [-1], ""):
        with pytest.raises(FlotillaError) as err:
            b.prepare(completion(bad))
        assert err.value.info.param == "prompt"
