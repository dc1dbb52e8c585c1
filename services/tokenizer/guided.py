"""Guided decoding: what `response_format` and `tool_choice` constrain the engine to generate,
checked here, before admission, so that a bad spec is a 400 and never reaches an engine.

Rules:
- tool_choice "required" or a named function (chat requests with tools) → the model family's
  call format (tool_formats.py): at least one call, exactly one when named or when
  parallel_tool_calls is false; arguments follow the tool's `parameters` schema. This wins over
  response_format.
- response_format (the one internal spelling, `TextRequest`'s docstring): response_formats.py.
- JSON schemas (tool parameters, response formats) and grammars are checked by
  grammar_check.py, which also holds `grammar_of`, the one conversion of a spec into an
  xgrammar Grammar (the engine compiles the very same).
- When the prompt leaves the model inside its reasoning block (it ends with `<think>`, as
  DeepSeek R1's template does), the constraint starts after `</think>`: reasoning stays free.
  gpt-oss (harmony) likewise: a response format starts after `<|channel|>final<|message|>`,
  its control tokens allowed before; a forced call is its own message (harmony's call syntax)
  and starts at once.
"""

from __future__ import annotations

import json
from typing import Any

from flotilla.libs.common.messages import GuidedDecoding, TextRequest
from flotilla.services.tokenizer.grammar_check import (  # noqa: F401 - grammar_of, xgrammar: engine's
    MAX_BOUND,
    check_schema,
    checked,
    grammar_of,
    xgrammar,
)
from flotilla.services.tokenizer.harmony import CONTROL, FINAL
from flotilla.services.tokenizer.response_formats import response_format_spec
from flotilla.services.tokenizer.tool_formats import ToolFormat


def tool_call_spec(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool,
                   fmt: ToolFormat) -> GuidedDecoding:
    """Calls forced by tool_choice "required" or a named function."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    chosen = []
    for i, tool in enumerate(tools):
        if named is not None and tool["function"]["name"] != named:
            continue
        parameters = tool["function"].get("parameters")
        if parameters is not None:
            parameters = check_schema(parameters, f"tools[{i}].function.parameters")
            tool = {**tool, "function": {**tool["function"], "parameters": parameters}}
        chosen.append(tool)
    tag = fmt.structural_tag(chosen, single=named is not None or not parallel)
    spec = GuidedDecoding(kind="structural_tag", value=json.dumps(tag, ensure_ascii=False),
                          special_tokens=list(fmt.markers))
    return checked(spec, "tools")


def after_reasoning(spec: GuidedDecoding, end_tag: str,
                    tokens: tuple[str, ...] = ()) -> GuidedDecoding:
    """The same constraint, once free text up to `end_tag` (and some whitespace) is written;
    `tokens`: control tokens allowed in that text."""
    value = spec.value or ""
    if spec.kind == "structural_tag":
        main = json.loads(value)["format"]
    elif spec.kind == "json_schema":
        main = {"type": "json_schema", "json_schema": json.loads(value)}
    elif spec.kind == "json_object":
        main = {"type": "json_schema", "json_schema": {"type": "object"}}
    elif spec.kind == "regex":
        main = {"type": "regex", "pattern": value}
    else:
        main = {"type": "grammar", "grammar": value}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end_tag},
        {"type": "regex", "pattern": "\\s{0,4}"}, main]}}
    return GuidedDecoding(kind="structural_tag", value=json.dumps(tag, ensure_ascii=False),
                          special_tokens=[*spec.special_tokens, end_tag, *tokens])


def forces_tool_calls(req: TextRequest) -> bool:
    choice = req.tool_choice
    return req.kind == "chat" and bool(req.tools) and (
        choice == "required" or isinstance(choice, dict))


def guided_spec(req: TextRequest, fmt: ToolFormat, reasoning_end: str | None = None,
                special_texts: frozenset[str] = frozenset()) -> GuidedDecoding | None:
    """The constraint of a request, or None (blocking: call it off the event loop).
    `reasoning_end`: the prompt opened a reasoning block that this tag closes.
    `special_texts`: the vocabulary's control-token texts (a client grammar may write them)."""
    spec: GuidedDecoding | None
    if forces_tool_calls(req):
        spec = tool_call_spec(req.tools or [], req.tool_choice, req.parallel_tool_calls, fmt)
    else:
        spec = response_format_spec(req.response_format, special_texts)
    if spec is None or reasoning_end is None:
        return spec
    if reasoning_end == FINAL:
        if forces_tool_calls(req):
            return spec
        return checked(after_reasoning(spec, FINAL, CONTROL), "response_format")
    return checked(after_reasoning(spec, reasoning_end), "response_format")
