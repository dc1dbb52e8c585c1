"""gpt-oss's harmony format against OpenAI's own `openai-harmony` package: our prompts (the
model's real chat template, `reasoning_effort`, tools) equal its rendering, and replies its
renderer writes come back through our output stage as its streaming parser reads them —
analysis as reasoning, final as content, commentary `to=functions.x` as tool calls — however
the reply's tokens are split into deltas."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.libs.common.messages import TextRequest, TokenDelta, TokenFinal
from flotilla.services.tokenizer.harmony import CONTROL, HarmonyParser, control_ids
from flotilla.services.tokenizer.output import OutputProcessor
from flotilla.services.tokenizer.prompt import PromptBuilder
from flotilla.services.tokenizer.tokenizer import Tokenizer

oh = pytest.importorskip("openai_harmony")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Web search",
                                           "parameters": {"type": "object", "properties": {
                                               "q": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]


@pytest.fixture(scope="module")
def tok(gptoss_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(gptoss_dir)


def request(messages: list[dict[str, Any]], tools: list | None = None,
            effort: str | None = None, parallel: bool = True) -> TextRequest:
    return TextRequest(request_id="r", model="m", kind="chat", messages=messages, tools=tools,
                       reasoning_effort=effort,  # type: ignore[arg-type]
                       parallel_tool_calls=parallel, stream_subject="s")


# ------------------------------------------------------------------ prompts


def reference_prompt(enc: Any, instructions: str | None, user: str, effort: str,
                     tools: list | None) -> str:
    system = oh.SystemContent.new().with_reasoning_effort(
        oh.ReasoningEffort(effort.capitalize())).with_conversation_start_date(
        datetime.date.today().isoformat())
    messages = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    if instructions or tools:
        dev = oh.DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([oh.ToolDescription.new(
                t["function"]["name"], t["function"]["description"],
                parameters=t["function"]["parameters"]) for t in tools])
        messages.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
    messages.append(oh.Message.from_role_and_content(oh.Role.USER, user))
    ids = enc.render_conversation_for_completion(oh.Conversation.from_messages(messages),
                                                 oh.Role.ASSISTANT)
    return str(enc.decode(ids))


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
@pytest.mark.parametrize("instructions,tools", [(None, None), ("Be terse.", None),
                                                ("Be terse.", TOOLS), (None, [WEATHER])])
def test_prompts_equal_openai_harmony(tok: Tokenizer, harmony_encoding: Any, effort: str,
                                      instructions: str | None, tools: list | None) -> None:
    messages = [{"role": "developer", "content": instructions}] if instructions else []
    messages.append({"role": "user", "content": "Weather in Paris? «é» 🙂"})
    ours = PromptBuilder(tok, 131072).render_chat(request(messages, tools, effort))
    expected = reference_prompt(harmony_encoding, instructions, messages[-1]["content"],
                                effort, tools)
    if instructions and not tools:  # the one difference: gpt-oss's own template (what
        # transformers renders too) ends the instructions with a blank line even without tools
        expected = expected.replace(f"{instructions}<|end|>", f"{instructions}\n\n<|end|>")
    assert ours == expected


def test_stops_at_the_end_of_the_reply_not_of_a_message(tok: Tokenizer) -> None:
    """`<|end|>` closes the analysis message: stopping there would lose the answer."""
    ends = {tok.text_of(i) for i in tok.end_of_generation_ids()}
    assert {"<|return|>", "<|call|>"} <= ends
    assert "<|end|>" not in ends


# ------------------------------------------------------------------ replies


def reference_reply(enc: Any, parts: list[tuple[str, str, str]]) -> list[int]:
    """The token ids of a reply made of (kind, name, text) messages, by openai-harmony's
    renderer; the prompt already holds the first `<|start|>assistant`."""
    ids: list[int] = []
    for kind, name, text in parts:
        msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text)
        if kind == "call":
            msg = msg.with_channel("commentary").with_recipient(
                f"functions.{name}").with_content_type("<|constrain|>json")
        else:
            msg = msg.with_channel({"preamble": "commentary"}.get(kind, kind))
        ids += enc.render(msg)
    return ids[2:]  # `<|start|>assistant`


def reference_parse(enc: Any, ids: list[int]) -> tuple[str, str, list[tuple[str, str]]]:
    """Reasoning, content and calls as openai-harmony's streaming parser reads the reply."""
    parser = oh.StreamableParser(enc, oh.Role.ASSISTANT)
    for i in ids:
        parser.process(i)
    reasoning, content, calls = "", "", []
    for msg in parser.messages:
        text = "".join(c.text for c in msg.content)
        if msg.recipient and msg.recipient.startswith("functions."):
            calls.append((msg.recipient.removeprefix("functions."), text))
        elif msg.channel == "analysis":
            reasoning += text
        else:
            content += text
    return reasoning, content, calls


def ours(tok: Tokenizer, ids: list[int], cuts: list[int], parallel: bool = True
         ) -> tuple[str, str, list[tuple[str, str]], str]:
    """Reasoning, content, calls and finish reason through our output stage, the reply's ids
    sent in the pieces `cuts` makes; the stop token (its last id) ends it as the engine does."""
    req = request([{"role": "user", "content": "hi"}], TOOLS, parallel=parallel)
    stop_ids = frozenset(tok.end_of_generation_ids())
    out = OutputProcessor.for_request(tok, req, "", 0, stop_ids=stop_ids)
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    deltas = [out.on_tokens(TokenDelta(token_ids=ids[a:b]))
              for a, b in zip(bounds, bounds[1:], strict=False)]
    last, final = out.on_final(TokenFinal(finish_reason="stop", prompt_tokens=0,
                                          completion_tokens=len(ids)))
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    for d in [*deltas, last]:
        if d is None:
            continue
        reasoning, content = reasoning + d.reasoning, content + d.text
        for call in d.tool_calls:
            if call.name is not None:
                assert call.id and call.index == len(calls)
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return reasoning, content, [(n, a) for n, a in calls.values()], final.finish_reason


TRICKY = ["<|", "|>", "to=functions.search", "<|channel|", "analysis", "final", "é", "🙂", "\n",
          " ", "{", "}", '"', "<|end", "message"]
texts = st.lists(st.sampled_from(TRICKY) | st.characters(codec="utf-8", exclude_categories=[
    "Cs", "Cc"]), min_size=1, max_size=8).map("".join).filter(
    lambda text: not any(c in text for c in CONTROL))  # read as the control tokens they spell
args = st.dictionaries(st.sampled_from(["city", "q", "unit"]), texts, max_size=2).map(
    lambda d: json.dumps(d, ensure_ascii=False))
part = st.one_of(st.tuples(st.sampled_from(["analysis", "preamble", "final"]), st.just(""),
                           texts),
                 st.tuples(st.just("call"), st.sampled_from(["get_weather", "search"]), args))


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(part, min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_replies_parse_as_openai_harmony_reads_them(tok: Tokenizer, harmony_encoding: Any,
                                                   parts: list, cuts: list[int]) -> None:
    ids = reference_reply(harmony_encoding, parts)
    if parts[-1][0] == "final":  # the model ends its answer with <|return|>, not <|end|>
        ids[-1] = tok.encode("<|return|>", add_special_tokens=False)[0]
    expected = reference_parse(harmony_encoding, ids)
    got = ours(tok, ids, cuts)
    assert got[:3] == expected
    assert ours(tok, ids, list(range(len(ids))))[:3] == expected  # one token at a time
    assert got[3] == ("tool_calls" if expected[2] else "stop")


def test_a_tool_call_streams_and_finishes_with_tool_calls(tok: Tokenizer,
                                                          harmony_encoding: Any) -> None:
    ids = reference_reply(harmony_encoding, [
        ("analysis", "", "Need the weather."), ("call", "get_weather", '{"city": "Paris"}')])
    reasoning, content, calls, finish = ours(tok, ids, [])
    assert (reasoning, content) == ("Need the weather.", "")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"


def test_parallel_false_keeps_the_first_call(tok: Tokenizer, harmony_encoding: Any) -> None:
    ids = reference_reply(harmony_encoding, [("call", "search", '{"q": "a"}'),
                                             ("call", "search", '{"q": "b"}')])
    assert ours(tok, ids, [], parallel=False)[2] == [("search", '{"q": "a"}')]


@pytest.mark.parametrize("reply,expected", [
    # a function the request does not offer: its arguments are content, not a call
    ('<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>',
     ("", "{}", [])),
    # the recipient in the role header; the content type without <|constrain|>
    ('<|channel|>analysis<|message|>think<|end|><|start|>assistant to=functions.search'
     '<|channel|>commentary json<|message|>{"q": 1}', ("think", "", [("search", '{"q": 1}')])),
    # no harmony at all: the model's text is content
    ("Just an answer, no channels.", ("", "Just an answer, no channels.", [])),
    # cut short (max_tokens) inside the reasoning
    ("<|channel|>analysis<|message|>still thinking <|e", ("still thinking <|e", "", [])),
])
def test_examples(reply: str, expected: tuple) -> None:
    for pieces in ([reply], list(reply)):
        parser = HarmonyParser(["search", "get_weather"])
        got = [parser.push(p) for p in pieces] + [parser.flush()]
        calls: list[list[str]] = []
        for g in got:
            for c in g.calls:
                if c.name is not None:
                    calls.append([c.name, ""])
                calls[-1][1] += c.arguments
        assert ("".join(g.reasoning for g in got), "".join(g.content for g in got),
                [tuple(c) for c in calls]) == expected


FRAGMENTS = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "assistant", "<|call|>",
             "<|constrain|>", "json", " to=functions.search", " to=functions.nope", "analysis",
             "final", "commentary", " ", "x", "<|", "|>", "{}", "\n"]


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=30),
       cuts=st.lists(st.integers(0, 10**4), max_size=10), parallel=st.booleans())
def test_any_text_parses_the_same_however_split(parts: list[str], cuts: list[int],
                                                parallel: bool) -> None:
    text = "".join(parts)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})

    def run(pieces: list[str]) -> tuple[str, str, list[tuple[int, str | None, str]]]:
        parser = HarmonyParser(["search"], parallel=parallel, new_id=lambda: "id")
        got = [parser.push(p) for p in pieces] + [parser.flush()]
        calls = [(c.index, c.name, c.arguments) for g in got for c in g.calls]
        merged: list[tuple[int, str | None, str]] = []
        for index, name, arguments in calls:  # pieces of one call join up
            if merged and merged[-1][0] == index and name is None:
                merged[-1] = (index, merged[-1][1], merged[-1][2] + arguments)
            else:
                merged.append((index, name, arguments))
        return ("".join(g.reasoning for g in got), "".join(g.content for g in got), merged)

    whole = run([text])
    assert run([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]) == whole
    assert len({i for i, _, _ in whole[2]}) <= (len(whole[2]) if parallel else 1)


def test_control_ids_only_for_harmony_vocabularies(tok: Tokenizer, qwen3_dir: Path) -> None:
    assert len(control_ids(tok)) == 7
    assert control_ids(Tokenizer.from_path(qwen3_dir)) == frozenset()


def test_a_forced_call_is_a_call_openai_harmony_reads(tok: Tokenizer, gptoss_dir: Path,
                                                     harmony_encoding: Any) -> None:
    """tool_choice "required" constrains gpt-oss to harmony's call syntax (detected from its
    template), which both parsers read as the call."""
    from flotilla.services.tokenizer.guided import tool_call_spec
    from flotilla.services.tokenizer.tool_formats import HARMONY, detect

    assert detect((gptoss_dir / "chat_template.jinja").read_text(), True) is HARMONY
    spec = tool_call_spec(TOOLS, "required", True, HARMONY)  # xgrammar compiles it
    assert spec.kind == "structural_tag" and "<|constrain|>" in spec.special_tokens
    text = HARMONY.calls_text([("search", '{"q": "gpt-oss"}')])
    ids = tok.encode(text, add_special_tokens=False)
    assert reference_parse(harmony_encoding, ids) == ("", "", [("search", '{"q": "gpt-oss"}')])
    assert ours(tok, ids, [])[2:] == ([("search", '{"q": "gpt-oss"}')], "tool_calls")
    from xgrammar.testing import _is_grammar_accept_string

    from flotilla.services.tokenizer.guided import grammar_of

    req = request([{"role": "user", "content": "Find gpt-oss"}], TOOLS)
    req.tool_choice = "required"
    guided = PromptBuilder(tok, 131072).prepare(req).guided
    assert guided is not None and _is_grammar_accept_string(grammar_of(guided), text)


def test_reasoning_before_a_call_is_rendered_back(tok: Tokenizer, gptoss_dir: Path) -> None:
    """A tool loop: the assistant's reasoning_content (and its preamble) come back as the
    template's `thinking`, rendered as transformers renders the same turn."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    sent = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Need weather.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    ours = PromptBuilder(tok, 131072).render_chat(request(sent, [WEATHER], "high"))
    hf = [sent[0], {"role": "assistant", "content": "", "thinking": "Need weather.",
                    "tool_calls": [{**call, "function": {**call["function"],
                                                         "arguments": {"city": "Paris"}}}]},
          sent[2]]
    expected, _ = render_jinja_template(
        [hf], chat_template=(gptoss_dir / "chat_template.jinja").read_text(), tools=[WEATHER],
        add_generation_prompt=True, reasoning_effort="high")
    assert ours == expected[0]
    assert "<|channel|>analysis<|message|>Need weather.<|end|>" in ours


def test_a_structured_answer_is_the_final_channel(tok: Tokenizer) -> None:
    """response_format constrains gpt-oss's final channel; its reasoning stays free."""
    from xgrammar.testing import _is_grammar_accept_string

    from flotilla.services.tokenizer.guided import grammar_of

    req = request([{"role": "user", "content": "A cat?"}])
    req.response_format = {"type": "json_object"}
    prepared = PromptBuilder(tok, 131072).prepare(req)
    assert prepared.guided is not None
    assert "<|end|>" in prepared.guided.special_tokens
    grammar = grammar_of(prepared.guided)
    assert _is_grammar_accept_string(grammar, '<|channel|>analysis<|message|>A cat.<|end|>'
                                     '<|start|>assistant<|channel|>final<|message|>{"cat": 1}')
    assert _is_grammar_accept_string(grammar, '<|channel|>final<|message|>{"cat": 1}')
    assert not _is_grammar_accept_string(grammar, '<|channel|>final<|message|>a cat')
