"""`reasoning_effort` mapped per chat template (services/tokenizer/thinking.py), on the real
templates llama.cpp collects. Where a template has a variable for it, our prompt must equal
transformers' rendering of the same template with the value the mapping promises; elsewhere the
prompt must carry the template's own marker of thinking on or off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import TextRequest
from flotilla.services.tokenizer.prompt import PromptBuilder
from flotilla.services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.test_real_templates import SIMPLE, load, with_specials

USER = SIMPLE[1:]  # no system message: Granite 3.3 writes its thinking prompt only then
DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def vocab(qwen3_dir: Path) -> Tokenizer:
    return load(qwen3_dir)[0]  # has <think> / </think>


def source_of(templates: Path, name: str) -> str:
    return (templates / f"{name}.jinja").read_text(encoding="utf-8")


def ours(tok: Tokenizer, source: str | None, effort: str | None,
         messages: list[dict[str, Any]] = SIMPLE, **kwargs: Any) -> str:
    req = TextRequest(request_id="r", model="m", kind="chat", messages=messages,
                      stream_subject="s", reasoning_effort=effort,  # type: ignore[arg-type]
                      chat_template_kwargs=kwargs or None)
    return PromptBuilder(tok, 65536, template_override=source).render_chat(req)


def reference(source: str, bos: str | None, eos: str, **variables: Any) -> str:
    transformers = pytest.importorskip("transformers")
    del transformers
    from transformers.utils.chat_template_utils import render_jinja_template

    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    rendered, _ = render_jinja_template([USER], chat_template=source,
                                        add_generation_prompt=True, **specials, **variables)
    return rendered[0]


# template, bos, eos, effort -> the variables transformers renders it with
BY_VARIABLE = [
    ("Qwen-Qwen3-0.6B", None, "<|im_end|>", {
        "none": {"enable_thinking": False}, "low": {"enable_thinking": True}}),
    ("deepseek-ai-DeepSeek-V3.1", DS_BOS, DS_EOS, {
        "none": {"thinking": False}, "high": {"thinking": True}}),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", DS_BOS, DS_EOS, {
        "none": {"enable_thinking": False}, "medium": {"enable_thinking": True}}),
    ("openai-gpt-oss-120b", None, "<|return|>", {
        "high": {"reasoning_effort": "high"}, "minimal": {"reasoning_effort": "low"}}),
    ("tencent-Hy3", None, "<|eos|>", {
        "none": {"reasoning_effort": "no_think"}, "medium": {"reasoning_effort": "high"},
        "minimal": {"reasoning_effort": "low"}}),
    ("upstage-Solar-Open-100B", None, "<|end|>", {
        "none": {"reasoning_effort": "minimal"}, "high": {"reasoning_effort": "high"}}),
    ("Cohere2MoE", None, "<|END_OF_TURN_TOKEN|>", {
        "none": {"reasoning_effort": "none"}, "high": {"reasoning_effort": "high"}}),
    ("ibm-granite-granite-3.3-2B-Instruct", None, "<|end_of_text|>", {
        "none": {"thinking": False}, "high": {"thinking": True}}),
    ("Kimi-K3", None, "<|im_end|>", {
        "none": {"thinking": False}, "medium": {"thinking": True, "thinking_effort": "high"},
        "minimal": {"thinking": True, "thinking_effort": "low"}}),
    ("HuggingFaceTB-SmolLM3-3B", None, "<|im_end|>", {
        "none": {"enable_thinking": False}, "high": {"enable_thinking": True}}),
    ("GLM-4.6", None, "<|endoftext|>", {
        "none": {"enable_thinking": False}, "high": {"enable_thinking": True}}),
    ("GLM-4.7-Flash", None, "<|endoftext|>", {
        "none": {"enable_thinking": False}, "low": {"enable_thinking": True}}),
    ("Qwen3.5-4B", None, "<|im_end|>", {
        "none": {"enable_thinking": False}, "medium": {"enable_thinking": True}}),
    ("google-gemma-4-31B-it", "<bos>", "<turn|>", {
        "none": {"enable_thinking": False}, "high": {"enable_thinking": True}}),
    ("deepseek-ai-DeepSeek-V3.2", DS_BOS, DS_EOS, {
        "none": {"thinking": False}, "high": {"thinking": True}}),
]


@pytest.mark.parametrize("name,bos,eos,cases", BY_VARIABLE, ids=[c[0] for c in BY_VARIABLE])
def test_efforts_set_the_templates_own_variables(llama_cpp_templates: Path, vocab: Tokenizer,
                                                 name: str, bos: str | None, eos: str,
                                                 cases: dict[str, dict[str, Any]]) -> None:
    source = source_of(llama_cpp_templates, name)
    tok = with_specials(vocab, bos, eos)
    texts = {}
    for effort, variables in cases.items():
        texts[effort] = ours(tok, source, effort, USER)
        assert texts[effort] == reference(source, bos, eos, **variables), effort
    assert len(set(texts.values())) == len(texts)  # each level changed the prompt


def test_the_thinking_markers(llama_cpp_templates: Path, vocab: Tokenizer) -> None:
    qwen = with_specials(vocab, None, "<|im_end|>")
    source = source_of(llama_cpp_templates, "Qwen-Qwen3-0.6B")
    assert ours(qwen, source, "none").endswith("<think>\n\n</think>\n\n")
    assert not ours(qwen, source, "high").endswith("</think>\n\n")
    smol3 = source_of(llama_cpp_templates, "HuggingFaceTB-SmolLM3-3B")
    assert "/no_think" in ours(qwen, smol3, "none") and "/think" in ours(qwen, smol3, "low")
    # llama.cpp's own R1 template opens the block itself and has no switch: it is closed
    r1 = source_of(llama_cpp_templates, "llama-cpp-deepseek-r1")
    ds = with_specials(vocab, DS_BOS, DS_EOS)
    assert ours(ds, r1, "high").endswith("<think>\n")
    assert ours(ds, r1, "none").endswith("<think>\n\n</think>\n\n")
    # Nemotron Nano 2 reads /think and /no_think from the system message only
    nemotron = source_of(llama_cpp_templates, "NVIDIA-Nemotron-Nano-v2")
    assert ours(qwen, nemotron, "none").endswith("Assistant\n<think></think>")
    assert ours(qwen, nemotron, "high").endswith("Assistant\n<think>\n")


def test_enable_thinking_wins_over_the_effort(llama_cpp_templates: Path,
                                              vocab: Tokenizer) -> None:
    qwen = with_specials(vocab, None, "<|im_end|>")
    source = source_of(llama_cpp_templates, "Qwen-Qwen3-0.6B")
    assert ours(qwen, source, "high", enable_thinking=False) == ours(qwen, source, "none")
    assert ours(qwen, source, "none", enable_thinking=True) == ours(qwen, source, "medium")


def test_models_that_cannot_honour_the_effort_refuse_it(llama_cpp_templates: Path,
                                                        vocab: Tokenizer,
                                                        smollm2: Tokenizer) -> None:
    gpt_oss = source_of(llama_cpp_templates, "openai-gpt-oss-120b")
    with pytest.raises(FlotillaError) as err:  # gpt-oss always reasons
        ours(with_specials(vocab, None, "<|return|>"), gpt_oss, "none")
    assert err.value.info.param == "reasoning_effort"
    # SmolLM2 has no thinking: `none` is what it does anyway, the others cannot be honoured;
    # nor has Qwen3-Coder, though its vocabulary has `<think>` (its template never writes it)
    coder = source_of(llama_cpp_templates, "Qwen3-Coder")
    qwen = with_specials(vocab, None, "<|im_end|>")
    assert ours(qwen, coder, "none", USER) == reference(
        coder, None, "<|im_end|>")
    for tok, source in ((smollm2, None), (qwen, coder)):
        assert ours(tok, source, "none") == ours(tok, source, None)
        with pytest.raises(FlotillaError) as err:
            ours(tok, source, "high")
        assert err.value.info.status == 400 and err.value.info.param == "reasoning_effort"
