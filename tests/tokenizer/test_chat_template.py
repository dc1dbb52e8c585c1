"""Chat rendering: equal to transformers' apply_chat_template (same GGUF tokenizer, same
template), sandboxed, time-bounded, tools always visible to the model, messages checked."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import TextRequest
from flotilla.services.tokenizer.prompt import PromptBuilder
from flotilla.services.tokenizer.tokenizer import Tokenizer

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Bonjour 🇫🇷, ça va ?"},
     {"role": "assistant", "content": "Oui, très bien !"},
     {"role": "user", "content": "Et toi?\n\n  indented\tline"}],
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# A Qwen-2.5-like template that reads `tools` and renders tool calls and tool results.
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You help.{% endif %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif not (tools and message.role == 'system') %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def chat(messages: list[dict[str, Any]], **kw: Any) -> TextRequest:
    return TextRequest(request_id="r", model="m", kind="chat", messages=messages,
                       stream_subject="s", **kw)


def builder(tok: Tokenizer, override: str | None = None, timeout: float = 2.0) -> PromptBuilder:
    return PromptBuilder(tok, 8192, template_override=override, template_timeout_s=timeout)


def error_of(fn: Any, *args: Any) -> FlotillaError:
    with pytest.raises(FlotillaError) as err:
        fn(*args)
    return err.value


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_rendering_equals_transformers(smollm2: Tokenizer, hf_reference,
                                               messages: list[dict[str, Any]],
                                               add_generation_prompt: bool) -> None:
    req = chat(messages, add_generation_prompt=add_generation_prompt)
    prepared = builder(smollm2).prepare(req)
    expected = hf_reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert prepared.text == expected
    ids = hf_reference.apply_chat_template(messages, tokenize=True,
                                           add_generation_prompt=add_generation_prompt)
    assert prepared.token_ids == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tool_conversation_equals_transformers(smollm2: Tokenizer, hf_reference) -> None:
    """A template that reads `tools` gets them natively, and tool-call arguments (JSON text in
    OpenAI's shape) reach it as objects, as transformers expects them."""
    args = {"city": "Paris"}
    openai_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    ]
    hf_messages = [dict(m) for m in openai_messages]
    hf_messages[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": args}}]}
    ours = builder(smollm2, TOOLS_TEMPLATE).prepare(chat(openai_messages, tools=[WEATHER_TOOL]))
    expected = hf_reference.apply_chat_template(hf_messages, tools=[WEATHER_TOOL],
                                                chat_template=TOOLS_TEMPLATE, tokenize=False,
                                                add_generation_prompt=True)
    assert ours.text == expected
    assert ours.text.count("get_weather") == 2  # once in <tools>, once in the call: no injection


def test_tools_are_injected_when_the_template_ignores_them(smollm2: Tokenizer) -> None:
    """SmolLM2's template never reads `tools`: the tools go into the system message."""
    text = builder(smollm2).prepare(
        chat([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])).text
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    assert json.dumps(WEATHER_TOOL) in system
    assert "<tool_call>" in system and '"arguments"' in system
    # an existing system message keeps its text, the tools follow it
    text = builder(smollm2).prepare(chat(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )).text
    assert text.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    assert "You must call the function `get_weather`." in text
    # tool_choice "none": the model is not shown the tools
    text = builder(smollm2).prepare(chat([{"role": "user", "content": "hi"}],
                                         tools=[WEATHER_TOOL], tool_choice="none")).text
    assert "get_weather" not in text


def test_template_injection_payloads_are_refused(smollm2: Tokenizer) -> None:
    for payload in ("{{ ''.__class__.__mro__ }}",
                    "{{ messages.__class__.__init__.__globals__ }}",
                    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
                    "{% set x = messages.append(1) %}"):
        err = error_of(builder(smollm2, payload).prepare, chat([{"role": "user", "content": "x"}]))
        assert err.status == 400 and err.info.code == "chat_template_error"
        assert "unsafe" in err.info.message or "undefined" in err.info.message
    # a payload inside a message is data, never evaluated
    payload = "{{ ''.__class__.__mro__ }}{% for i in range(10**9) %}x{% endfor %}"
    text = builder(smollm2).prepare(chat([{"role": "user", "content": payload}])).text
    assert payload in text


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for m in messages * 100000 %}"
    "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}",
])
def test_endless_templates_stop_within_budget(smollm2: Tokenizer, template: str) -> None:
    b = builder(smollm2, template, timeout=0.5)
    start = time.monotonic()
    err = error_of(b.prepare, chat([{"role": "user", "content": "x"}]))
    elapsed = time.monotonic() - start
    if "budget" in err.info.message:  # overload to retry, never a 400 clients do not retry
        assert err.status == 503 and err.info.retry_after_s
    else:
        assert err.status == 400 and err.info.code == "chat_template_error"
        assert "limit" in err.info.message
    assert elapsed < 1.5
    assert builder(smollm2).prepare(chat([{"role": "user", "content": "ok"}])).token_ids


def test_resource_amplifiers_are_refused(smollm2: Tokenizer) -> None:
    for template in ("{{ 'x' * 1000000000 }}", "{{ 'x' | center(1000000000) }}",
                     "{{ '%1000000000s' % 'x' }}", "{{ 'x'.ljust(1000000000) }}",
                     "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"):
        err = error_of(builder(smollm2, template).prepare, chat([{"role": "user", "content": "x"}]))
        assert err.info.code == "chat_template_error", template


def test_hf_helpers_and_kwargs_allowlist(smollm2: Tokenizer) -> None:
    template = ("{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|"
                "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}|"
                "{{ strftime_now('%Y') | length }}"
                "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{% endfor %}")
    text = builder(smollm2, template).prepare(chat(
        [{"role": "user", "content": "é"}], chat_template_kwargs={"enable_thinking": False})).text
    assert text == '<|im_start|>|<|im_end|>|[{"role": "user", "content": "é"}]|/no_think|4'
    err = error_of(builder(smollm2).prepare, chat([{"role": "user", "content": "x"}],
                                                  chat_template_kwargs={"messages": []}))
    assert err.status == 400 and err.info.param == "chat_template_kwargs.messages"
    err = error_of(builder(smollm2).prepare, chat([{"role": "user", "content": "x"}],
                                                  chat_template_kwargs={"enable_thinking": "no"}))
    assert err.info.param == "chat_template_kwargs.enable_thinking"
    err = error_of(builder(smollm2, "{{ raise_exception('no system role') }}").prepare,
                   chat([{"role": "user", "content": "x"}]))
    assert err.info.message == "chat template error: no system role"


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}],
     "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r", "tool_call_id": "c9"}],
     "messages[1].tool_call_id"),
    ([{"role": "assistant"}], "messages[0].content"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                            "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_message_semantics_are_checked(smollm2: Tokenizer, messages: list[dict[str, Any]],
                                       param: str) -> None:
    err = error_of(builder(smollm2).prepare, chat(messages))
    assert err.status == 400 and err.info.param == param


def test_text_parts_and_developer_role(smollm2: Tokenizer) -> None:
    text = builder(smollm2).prepare(chat([
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])).text
    assert text.startswith("<|im_start|>system\nRules.<|im_end|>")
    assert "<|im_start|>user\na\nb<|im_end|>" in text
