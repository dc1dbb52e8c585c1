"""The vLLM / OpenAI text options the tokenizer honours (issue 20), each against an independent
reference where one exists: `continue_final_message` (transformers' apply_chat_template), `echo`
on chat, `suffix` (fill-in-the-middle; the model's own FIM text through transformers),
`skip_special_tokens`, `include_stop_str_in_output`, prompt logprobs, and the check of finished
structured outputs (jsonschema)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import SamplingOptions, TextRequest
from flotilla.services.tokenizer.prompt import PromptBuilder
from flotilla.services.tokenizer.service import TokenizerService
from flotilla.services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.fake_engine import FakeEngine, Script
from tests.tokenizer.harness import gateway, request

PREFILL = [{"role": "user", "content": "Name a colour."},
           {"role": "assistant", "content": "The colour I pick is "}]


def chat(messages: list[dict[str, Any]], **kw: Any) -> TextRequest:
    return TextRequest(request_id="r", model="m", kind="chat", messages=messages,
                       stream_subject="s", **kw)


def test_continue_final_message_matches_transformers(smollm2: Tokenizer, hf_reference,
                                                     qwen3_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    qwen = Tokenizer.from_path(qwen3_dir)
    qwen_reference = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    for tok, reference in ((smollm2, hf_reference), (qwen, qwen_reference)):
        for messages in (PREFILL, [*PREFILL[:1], {"role": "assistant", "content": "Red, "}]):
            req = chat(messages, continue_final_message=True, add_generation_prompt=False)
            ours = PromptBuilder(tok, 8192).prepare(req).text
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     continue_final_message=True)
            assert ours == expected
            assert ours.rstrip().endswith(messages[-1]["content"].rstrip())
    with pytest.raises(FlotillaError) as err:  # vLLM refuses both at once
        PromptBuilder(smollm2, 8192).prepare(chat(PREFILL, continue_final_message=True))
    assert err.value.info.param == "continue_final_message"


def test_echo_on_chat_repeats_the_assistant_prefill(smollm2: Tokenizer) -> None:
    builder = PromptBuilder(smollm2, 8192)
    prefill = chat(PREFILL, echo=True, continue_final_message=True, add_generation_prompt=False)
    assert builder.prepare(prefill).echo == PREFILL[-1]["content"]
    assert builder.prepare(chat(PREFILL[:1], echo=True)).echo == ""  # last turn is the user's


def test_fill_in_the_middle(smollm2: Tokenizer, qwen3_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    qwen = Tokenizer.from_path(qwen3_dir)
    reference = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    req = TextRequest(request_id="r", model="m", kind="completion", prompt=prefix,
                      suffix=suffix, stream_subject="s")
    ids = PromptBuilder(qwen, 8192).prepare(req).token_ids
    expected = reference.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
                                add_special_tokens=False)
    assert ids == expected
    with pytest.raises(FlotillaError) as err:  # SmolLM2's vocabulary dropped StarCoder's FIM
        PromptBuilder(smollm2, 8192).prepare(req)
    assert err.value.info.param == "suffix" and "fill-in-the-middle" in err.value.info.message


def test_fill_in_the_middle_with_deepseek_coder_tokens(llama_cpp_vocab: Path) -> None:
    tok = Tokenizer.from_path(llama_cpp_vocab / "ggml-vocab-deepseek-coder.gguf")
    req = TextRequest(request_id="r", model="m", kind="completion", prompt="x = ",
                      suffix="\ny = x", stream_subject="s")
    ids = PromptBuilder(tok, 8192).prepare(req).token_ids
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<｜fim▁begin｜>x = <｜fim▁hole｜>\ny = x<｜fim▁end｜>"), text


@pytest.fixture
def im(smollm2: Tokenizer) -> dict[str, int]:
    return {t: smollm2.encode(t, add_special_tokens=False)[0]
            for t in ("<|im_start|>", "<|im_end|>")}


async def test_special_tokens_and_stop_text_in_the_output(
        bus: Bus, service: TokenizerService, engine: FakeEngine, smollm2: Tokenizer,
        im: dict[str, int]) -> None:
    hello = smollm2.encode("Hi there", add_special_tokens=False)
    engine.script = Script(chunks=[hello[:1], [im["<|im_start|>"]], hello[1:],
                                   [im["<|im_end|>"]]])

    async def text(**kw: Any) -> str:
        out = await gateway(bus, service.model, request(**kw))
        assert out.frames[-1].kind == "final"
        return out.text

    first, rest = smollm2.decode(hello[:1]), smollm2.decode(hello[1:])
    assert (first, rest) == ("Hi", " there")
    assert await text() == first + rest
    # the special token between is text now; the one the engine stopped at is not (vLLM)
    assert await text(skip_special_tokens=False) == first + "<|im_start|>" + rest
    assert await text(skip_special_tokens=False, include_stop_str_in_output=True) == (
        first + "<|im_start|>" + rest + "<|im_end|>")
    assert await text(stop=[" there"]) == "Hi"
    assert await text(stop=["there"], include_stop_str_in_output=True) == "Hi there"


async def test_prompt_logprobs_are_passed_on_as_text(
        bus: Bus, service: TokenizerService, engine: FakeEngine, smollm2: Tokenizer) -> None:
    engine.script = Script(chunks=[[28], [29]])
    out = await gateway(bus, service.model, request(
        "completion", prompt="The capital of France",
        sampling=SamplingOptions(prompt_logprobs=1, max_tokens=2)))
    prompt_ids = engine.requests[-1].prompt_token_ids
    deltas = [f.data for f in out.frames if f.data and f.data.prompt_logprobs is not None]
    assert len(deltas) == 1
    lps = deltas[0].prompt_logprobs
    assert lps is not None and len(lps) == len(prompt_ids) and lps[0] is None
    for lp, token_id in zip(lps[1:], prompt_ids[1:], strict=True):
        assert lp is not None and lp.token == smollm2.token_text(token_id)
        assert bytes(lp.bytes or []) == smollm2.token_bytes[token_id]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}},
          "required": ["n"]}


@pytest.mark.parametrize("reply,finish,ok", [
    ('{"n": 3}', "stop", True),
    ('{"n": 7}', "stop", False),   # a violation is an error, never a silent return
    ('{"n": ', "length", True),    # cut short: "length" already says it is incomplete
    ('{"n": ', "stop", False),
])
async def test_finished_json_is_checked_against_the_clients_schema(
        bus: Bus, service: TokenizerService, engine: FakeEngine, smollm2: Tokenizer,
        im: dict[str, int], reply: str, finish: str, ok: bool) -> None:
    ids = smollm2.encode(reply, add_special_tokens=False)
    engine.script = Script(chunks=[ids] + ([[im["<|im_end|>"]]] if finish == "stop" else []),
                           finish=finish)
    out = await gateway(bus, service.model, request(response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}))
    assert out.admission.accepted
    assert out.text == reply
    if ok:
        assert out.frames[-1].kind == "final" and out.error is None
    else:
        assert out.error is not None and out.error.info.code == "invalid_structured_output"
        assert json.dumps(SCHEMA) and out.error.info.status == 500
