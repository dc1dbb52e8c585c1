"""Fields this server cannot honour, and combinations that contradict themselves, are refused
with a 400 that names the parameter — never accepted and ignored."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway.test_http import assert_error

USER = [{"role": "user", "content": "x"}]
FN = {"name": "f", "parameters": {"type": "object"}}

BAD_COMPAT_CHAT: list[tuple[str, dict[str, Any], str, str]] = [
    # (what, body without model, param, message fragment)
    ("verbosity low", {"verbosity": "low"}, "verbosity", "not supported"),
    ("audio output", {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio"),
    ("audio modality", {"modalities": ["text", "audio"]}, "modalities[1]", "text only"),
    ("web search", {"web_search_options": {}}, "web_search_options", "web search"),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}, "moderation",
     "moderation"),
    ("reasoning effort value", {"reasoning_effort": "extreme"}, "reasoning_effort",
     "Supported values"),
    ("both generation prompt options", {"continue_final_message": True,
                                        "add_generation_prompt": True},
     "continue_final_message", "cannot both"),
    ("n_predict zero", {"n_predict": 0}, "n_predict", "-1"),
    ("n_predict beside max_tokens", {"n_predict": 5, "max_tokens": 5}, "n_predict", "one of"),
    ("min_tokens above max", {"min_tokens": 9, "max_completion_tokens": 4}, "min_tokens",
     "cannot be above"),
    ("logit_bias range", {"logit_bias": {"5": 101}}, "logit_bias.5", "maximum of 100"),
    ("logit_bias key", {"logit_bias": {"-5": 1}}, "logit_bias", "not a token id"),
    ("stop_token_ids negative", {"stop_token_ids": [-1]}, "stop_token_ids[0]", "minimum"),
    ("prompt_logprobs range", {"prompt_logprobs": 21}, "prompt_logprobs", "maximum of 20"),
    ("priority type", {"priority": "high"}, "priority", "expected an integer"),
    ("functions beside tools", {"functions": [FN], "tools": []}, "functions", "cannot both"),
    ("function_call beside tool_choice", {"functions": [FN], "function_call": "auto",
                                          "tool_choice": "auto"}, "function_call",
     "cannot both"),
    ("parallel calls with functions", {"functions": [FN], "parallel_tool_calls": True},
     "parallel_tool_calls", "at most one"),
    ("function_call unknown", {"functions": [FN], "function_call": {"name": "g"}},
     "tool_choice.function.name", "not among the tools"),
    ("allowed tool unknown", {"tools": [{"type": "function", "function": FN}], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "g"}}]}}},
     "tool_choice.allowed_tools.tools[0].function.name", "not among the tools"),
    ("custom tool", {"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools[0].type",
     "only `function`"),
    ("two spellings", {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex", "both constrain"),
    ("two vLLM spellings", {"guided_json": {"type": "object"}, "guided_choice": ["a"]},
     "guided_choice", "both constrain"),
    ("structured_outputs and llama.cpp", {"structured_outputs": {"regex": "a"},
                                          "grammar": "root ::= \"a\""}, "grammar",
     "both constrain"),
    ("two structured_outputs kinds", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs.choice", "two constraints"),
    ("empty structured_outputs", {"structured_outputs": {"disable_fallback": True}},
     "structured_outputs", "needs one of"),
    ("structured_outputs whitespace pattern", {"structured_outputs": {
        "json": {}, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ("guided_json text", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("structured_outputs json text", {"structured_outputs": {"json": "[1]"}},
     "structured_outputs.json", "JSON Schema"),
    ("structural_tag text", {"structured_outputs": {"structural_tag": "nope"}},
     "structured_outputs.structural_tag", "not valid JSON"),
    ("structural_tag without format", {"response_format": {"type": "structural_tag"}},
     "response_format", "needs `format`"),
    ("guided_choice empty", {"guided_choice": []}, "guided_choice", "at least 1"),
    ("guided whitespace", {"guided_json": {}, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern", "not supported"),
    ("image part", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
     "messages[0].content[1].type", "text only"),
    ("audio part", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}]},
     "messages[0].content[0].type", "text only"),
    ("assistant audio reference", {"messages": [
        *USER, {"role": "assistant", "content": "a", "audio": {"id": "audio_1"}}, *USER]},
     "messages[1].audio", "no audio"),
]


@pytest.mark.parametrize("what,extra,param,fragment", BAD_COMPAT_CHAT,
                         ids=[c[0] for c in BAD_COMPAT_CHAT])
async def test_unhonourable_chat_fields_are_refused_by_name(
        client: httpx.AsyncClient, model: str, what: str, extra: dict[str, Any], param: str,
        fragment: str) -> None:
    r = await client.post("/v1/chat/completions", json={"model": model, "messages": USER,
                                                        **extra})
    assert_error(r, 400, param=param, contains=fragment)


BAD_COMPAT_COMPLETIONS: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat-only field", {"reasoning_effort": "low"}, "reasoning_effort", "not supported"),
    ("functions", {"functions": [FN]}, "functions", "not supported"),
    ("echo-less min_tokens", {"min_tokens": 20, "max_tokens": 3}, "min_tokens",
     "cannot be above"),
    ("two spellings", {"json_schema": {"type": "object"}, "grammar": "root ::= \"a\""},
     "grammar", "both constrain"),
    ("n_predict beside max_tokens", {"n_predict": 3, "max_tokens": 3}, "n_predict", "one of"),
]


@pytest.mark.parametrize("what,extra,param,fragment", BAD_COMPAT_COMPLETIONS,
                         ids=[c[0] for c in BAD_COMPAT_COMPLETIONS])
async def test_unhonourable_completion_fields_are_refused_by_name(
        client: httpx.AsyncClient, model: str, what: str, extra: dict[str, Any], param: str,
        fragment: str) -> None:
    r = await client.post("/v1/completions", json={"model": model, "prompt": "x", **extra})
    assert_error(r, 400, param=param, contains=fragment)
