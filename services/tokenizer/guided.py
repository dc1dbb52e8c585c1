"""Guided decoding: what `response_format` and `tool_choice` constrain the engine to generate,
checked here, before admission, so that a bad spec is a 400 and never reaches an engine.

Rules:
- tool_choice "required" or a named function (chat requests with tools) → the model family's
  call format (tool_formats.py): at least one call, exactly one when named or when
  parallel_tool_calls is false; arguments follow the tool's `parameters` schema. This wins over
  response_format.
- response_format json_object → one JSON object; json_schema → an instance of its `schema`
  (xgrammar's strict mode: no properties beyond those declared, so every output validates, with
  or without `strict`); text (or none) → no constraint. Output JSON is compact (`", "`, `": "`).
- A schema is refused (400, `param` names it) when it is not an object, exceeds MAX_SCHEMA_CHARS
  or MAX_DEPTH, has a size bound (maxLength, maxItems, ...) above MAX_BOUND, breaks the JSON
  Schema 2020-12 metaschema, or xgrammar cannot convert it.
- When the prompt leaves the model inside its reasoning block (it ends with `<think>`, as
  DeepSeek R1's template does), the constraint starts after `</think>`: reasoning stays free.
- `grammar_of(spec)` is the one conversion of a spec into an xgrammar Grammar; the engine compiles
  the very same (services/engine/structured.py).
"""

from __future__ import annotations

import functools
import importlib
import json
from types import ModuleType
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from libs.common.errors import FlotillaError, invalid_request
from libs.common.messages import GuidedDecoding, TextRequest
from services.tokenizer.tool_formats import ToolFormat

if TYPE_CHECKING:
    import xgrammar as xgr

MAX_SCHEMA_CHARS = 65_536
MAX_DEPTH = 32
MAX_BOUND = 4_096
_BOUNDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties",
           "maxContains", "minContains")
_JSON_OBJECT = '{"type": "object"}'


@functools.cache
def xgrammar() -> ModuleType:
    """The xgrammar module, imported on first use (it takes seconds)."""
    return importlib.import_module("xgrammar")


def grammar_of(spec: GuidedDecoding) -> xgr.Grammar:
    """The xgrammar Grammar of a spec (raises on a bad one)."""
    grammar = xgrammar().Grammar
    if spec.kind == "json_object":
        return grammar.from_json_schema(_JSON_OBJECT, any_whitespace=False, strict_mode=False)
    value = spec.value or ""
    if spec.kind == "json_schema":
        return grammar.from_json_schema(value, any_whitespace=False, strict_mode=True)
    if spec.kind == "structural_tag":
        return grammar.from_structural_tag(value)
    return grammar.from_ebnf(value)


def _bad(message: str, param: str) -> FlotillaError:
    return invalid_request(message, param=param, code="invalid_json_schema")


def check_schema(schema: Any, param: str) -> str:
    """The schema as compact JSON text, or a 400 naming `param` (see module rules)."""
    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON Schema object", param)
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise _bad(f"{param} is too large ({len(text)} characters; at most "
                   f"{MAX_SCHEMA_CHARS})", param)
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _bad(f"{param} is nested too deeply (at most {MAX_DEPTH} levels)", param)
        if isinstance(node, dict):
            for key in _BOUNDS:
                bound = node.get(key)
                if isinstance(bound, int | float) and bound > MAX_BOUND:
                    raise _bad(f"{param}: {key} {bound} is above this server's limit of "
                               f"{MAX_BOUND}", param)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise _bad(f"{param} is not a valid JSON Schema: {exc.message}", param) from None
    return text


def _checked(spec: GuidedDecoding, param: str) -> GuidedDecoding:
    try:
        grammar_of(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise _bad(f"{param} cannot be used for structured output: {reason}", param) from None
    return spec


def tool_call_spec(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool,
                   fmt: ToolFormat) -> GuidedDecoding:
    """Calls forced by tool_choice "required" or a named function."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    chosen = [t for t in tools if named is None or t["function"]["name"] == named]
    for i, tool in enumerate(tools):
        if tool in chosen and tool["function"].get("parameters") is not None:
            check_schema(tool["function"]["parameters"], f"tools[{i}].function.parameters")
    tag = fmt.structural_tag(chosen, single=named is not None or not parallel)
    spec = GuidedDecoding(kind="structural_tag", value=json.dumps(tag, ensure_ascii=False),
                          special_tokens=list(fmt.markers))
    return _checked(spec, "tools")


def response_format_spec(response_format: dict[str, Any] | None) -> GuidedDecoding | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return GuidedDecoding(kind="json_object")
    if kind != "json_schema":
        return None
    param = "response_format.json_schema.schema"
    body = response_format.get("json_schema") if response_format else None
    schema = body.get("schema") if isinstance(body, dict) else None
    if schema is None:
        raise _bad("response_format json_schema needs json_schema.schema", param)
    spec = GuidedDecoding(kind="json_schema", value=check_schema(schema, param))
    return _checked(spec, param)


def after_reasoning(spec: GuidedDecoding, end_tag: str) -> GuidedDecoding:
    """The same constraint, once free text up to `end_tag` (and some whitespace) is written."""
    if spec.kind == "structural_tag":
        main = json.loads(spec.value or "{}")["format"]
    elif spec.kind == "json_schema":
        main = {"type": "json_schema", "json_schema": json.loads(spec.value or "{}")}
    elif spec.kind == "json_object":
        main = {"type": "json_schema", "json_schema": {"type": "object"}}
    else:
        return spec
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end_tag},
        {"type": "regex", "pattern": "\\s{0,4}"}, main]}}
    return GuidedDecoding(kind="structural_tag", value=json.dumps(tag, ensure_ascii=False),
                          special_tokens=[*spec.special_tokens, end_tag])


def guided_spec(req: TextRequest, fmt: ToolFormat,
                reasoning_end: str | None = None) -> GuidedDecoding | None:
    """The constraint of a request, or None (blocking: call it off the event loop).
    `reasoning_end`: the prompt opened a reasoning block that this tag closes."""
    choice = req.tool_choice
    spec: GuidedDecoding | None
    if req.kind == "chat" and req.tools and (choice == "required" or isinstance(choice, dict)):
        spec = tool_call_spec(req.tools, choice, req.parallel_tool_calls, fmt)
    else:
        spec = response_format_spec(req.response_format)
    if spec is None or reasoning_end is None:
        return spec
    return _checked(after_reasoning(spec, reasoning_end), "response_format")
