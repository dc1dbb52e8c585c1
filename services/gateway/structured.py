"""Structured output in every spelling clients send → the one internal `response_format`.

Spellings (in this order; two in one request → 400 naming the later one):
- OpenAI `response_format`: `text` (no constraint), `json_object`, `json_schema`; llama.cpp's
  `{"type": "json_object" | "json_schema", "schema": {...}}` (the schema without the
  `json_schema` wrapper); vLLM's `{"type": "structural_tag", ...}`;
- vLLM `structured_outputs`: exactly one of `json` (a schema, or its JSON text), `regex`,
  `choice`, `grammar`, `json_object: true`, `structural_tag` (JSON text); its options
  `disable_any_whitespace`, `disable_additional_properties` and `disable_fallback` are accepted
  without effect, because every output this server writes already satisfies them (compact JSON,
  no undeclared properties, one grammar backend);
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with
  `guided_decoding_backend`, accepted: there is one backend, xgrammar);
- llama.cpp's top-level `json_schema` (a schema) and `grammar` (GBNF).
The internal spellings (TextRequest's docstring): `{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"schema": {...}, ...}}`, `{"type": "regex", "regex"}`,
`{"type": "choice", "choice": [...]}`, `{"type": "grammar", "grammar"}` and
`{"type": "structural_tag", "structural_tag": {...}}`, whose object is what xgrammar reads
(`{"type": "structural_tag", "format": ...}`, or the older `structures` + `triggers` form).
Shapes are checked by the spec first; this module checks what it cannot (JSON text that must
parse, one constraint per request). Whether a schema, regex or grammar can be enforced is the
tokenizer's decision (a 400 from there).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from flotilla.libs.common.errors import invalid_request

Format = dict[str, Any]
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _json_text(value: Any, param: str, what: str) -> dict[str, Any]:
    """A JSON object given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise invalid_request(f"`{param}` is not valid JSON: {exc.msg}.", param=param,
                                  code="invalid_value") from None
    if not isinstance(value, dict):
        raise invalid_request(f"`{param}` must be {what} (a JSON object).", param=param,
                              code="invalid_value")
    return value


def _schema(value: Any, param: str) -> Format:
    return {"type": "json_schema", "json_schema": {"schema": _json_text(value, param,
                                                                         "a JSON Schema")}}


def _response_format(fmt: dict[str, Any]) -> Format | None:
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "structural_tag":
        return {"type": "structural_tag", "structural_tag": dict(fmt)}
    if "schema" in fmt:  # llama.cpp: the schema itself, without OpenAI's json_schema wrapper
        return _schema(fmt["schema"], "response_format.schema")
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance((fmt.get("json_schema") or {}).get("schema"), dict):
        raise invalid_request("`response_format.json_schema.schema` is required for type "
                              "json_schema.", param="response_format.json_schema.schema")
    return {"type": "json_schema", "json_schema": dict(fmt["json_schema"])}


def _structured_outputs(options: dict[str, Any]) -> Format:
    chosen = [k for k in _KINDS if options.get(k) not in (None, False)]
    if not chosen:
        raise invalid_request(
            "`structured_outputs` needs one of " + ", ".join(f"`{k}`" for k in _KINDS) + ".",
            param="structured_outputs")
    if len(chosen) > 1:
        raise invalid_request(
            f"`structured_outputs.{chosen[1]}` and `structured_outputs.{chosen[0]}` are two "
            "constraints; send one.", param=f"structured_outputs.{chosen[1]}")
    kind, value = chosen[0], options[chosen[0]]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        return _schema(value, param)
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "structural_tag":
        return {"type": "structural_tag",
                "structural_tag": _json_text(value, param, "a structural tag")}
    return {"type": kind, kind: value}


_SPELLINGS: dict[str, Callable[[Any], Format | None]] = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda v: _schema(v, "guided_json"),
    "guided_regex": lambda v: {"type": "regex", "regex": v},
    "guided_choice": lambda v: {"type": "choice", "choice": list(v)},
    "guided_grammar": lambda v: {"type": "grammar", "grammar": v},
    "json_schema": lambda v: _schema(v, "json_schema"),
    "grammar": lambda v: {"type": "grammar", "grammar": v},
}


def structured_output(body: dict[str, Any]) -> Format | None:
    """The request's one constraint in the internal spelling, or None (see the module rules)."""
    found: list[tuple[str, Format]] = []
    for name, convert in _SPELLINGS.items():
        value = body.get(name)
        if value is None:
            continue
        fmt = convert(value)
        if fmt is None:
            continue
        if found:
            raise invalid_request(
                f"`{name}` and `{found[0][0]}` both constrain the output; send one of them.",
                param=name)
        found.append((name, fmt))
    return found[0][1] if found else None
