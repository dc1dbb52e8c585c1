"""`TextRequest.response_format` (the one internal spelling the gateway normalises every
structured-output form to) → the engine's `GuidedDecoding`.

Rules (each refusal is a 400 whose `param` is `response_format.<kind>...`):
- `text` or none → no constraint; `json_object` → one JSON object;
- `json_schema` → an instance of `json_schema.schema` (grammar_check.check_schema: xgrammar's
  strict mode, so no properties beyond those declared; keywords it cannot enforce are refused);
- `regex` → text matching the regular expression (xgrammar's dialect: no lookaround, no `\\p`);
- `choice` → exactly one of the listed strings (an EBNF alternation of escaped literals);
- `grammar` → llama.cpp GBNF or xgrammar EBNF (gbnf.py converts what differs, refuses token
  references);
- `structural_tag` → xgrammar's structural tag, in its current form (`{"format": {...}}`, with
  or without `"type": "structural_tag"`) or vLLM's older one (`structures` of `begin` /
  `schema` / `end` plus `triggers`); every JSON schema inside is checked as above.
- Control tokens whose text a grammar, choice or tag writes (e.g. `<tool_call>` in a Qwen
  vocabulary) are allowed to be generated (`GuidedDecoding.special_tokens`).
Sizes: a regex, grammar or tag longer than MAX_SPEC_CHARS, more than MAX_CHOICES choices or
choices longer than MAX_SPEC_CHARS in all are refused.
"""

from __future__ import annotations

import json
from typing import Any

from flotilla.libs.common.errors import FlotillaError, invalid_request
from flotilla.libs.common.messages import GuidedDecoding
from flotilla.services.tokenizer.gbnf import GrammarError, to_xgrammar_ebnf
from flotilla.services.tokenizer.grammar_check import check_schema, checked

MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 1_024
KINDS = ("text", "json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")


def _bad(message: str, param: str) -> FlotillaError:
    return invalid_request(message, param=param, code="invalid_value")


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    param = f"response_format.{key}"
    if not isinstance(value, str) or not value:
        raise _bad(f"{param} must be a non-empty string", param)
    if len(value) > MAX_SPEC_CHARS:
        raise _bad(f"{param} is too long ({len(value)} characters; at most {MAX_SPEC_CHARS})",
                   param)
    return value


def _ebnf_literal(text: str) -> str:
    """`text` as an xgrammar EBNF string literal (control characters as \\x escapes)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: Any) -> str:
    param = "response_format.choice"
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) for c in choices):
        raise _bad(f"{param} must be a non-empty list of strings", param)
    if len(choices) > MAX_CHOICES or sum(map(len, choices)) > MAX_SPEC_CHARS:
        raise _bad(f"{param} is too large (at most {MAX_CHOICES} choices, {MAX_SPEC_CHARS} "
                   "characters in all)", param)
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in dict.fromkeys(choices))


def _specials_in(text: str, special_texts: frozenset[str]) -> list[str]:
    return sorted(t for t in special_texts if t and t in text)


def structural_tag_value(tag: Any) -> str:
    """The tag as xgrammar's current structural-tag JSON, its schemas checked."""
    param = "response_format.structural_tag"
    if not isinstance(tag, dict):
        raise _bad(f"{param} must be an object", param)
    if "structures" in tag:  # vLLM's older form: tags triggered inside free text
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
            raise _bad(f"{param} needs `structures` (a list) and `triggers` (a list)", param)
        tags = []
        for i, item in enumerate(structures):
            where = f"{param}.structures[{i}]"
            if not isinstance(item, dict) or not all(
                    isinstance(item.get(k), str) for k in ("begin", "end")):
                raise _bad(f"{where} needs string `begin` and `end`", where)
            schema = check_schema(item.get("schema", {"type": "object"}), f"{where}.schema")
            tags.append({"type": "tag", "begin": item["begin"], "end": item["end"],
                         "content": {"type": "json_schema", "json_schema": schema}})
        tag = {"format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    if not isinstance(tag.get("format"), dict):
        raise _bad(f"{param} needs a `format` object (xgrammar's structural tag)", param)
    fmt = _checked_schemas(tag["format"], f"{param}.format")
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _checked_schemas(node: Any, param: str) -> Any:
    """`node` (a structural-tag format) with every `json_schema` in it checked and rewritten."""
    if isinstance(node, list):
        return [_checked_schemas(x, f"{param}[{i}]") for i, x in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "json_schema" and node.get("type") == "json_schema":
            out[key] = check_schema(value, f"{param}.json_schema")
        else:
            out[key] = _checked_schemas(value, f"{param}.{key}")
    return out


def response_format_spec(response_format: dict[str, Any] | None,
                         special_texts: frozenset[str] = frozenset()) -> GuidedDecoding | None:
    """The constraint of a response format (see module rules), checked by xgrammar."""
    body = response_format or {}
    kind = body.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(kind="json_object")
    if kind == "json_schema":
        param = "response_format.json_schema.schema"
        inner = body.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if schema is None:
            raise invalid_request("response_format json_schema needs json_schema.schema",
                                  param=param, code="invalid_json_schema")
        value = json.dumps(check_schema(schema, param), ensure_ascii=False)
        return checked(GuidedDecoding(kind="json_schema", value=value), param)
    if kind == "regex":
        return checked(GuidedDecoding(kind="regex", value=_text(body, "regex")),
                       "response_format.regex")
    if kind == "choice":
        grammar = choice_grammar(body.get("choice"))
        return checked(GuidedDecoding(kind="grammar", value=grammar,
                                      special_tokens=_specials_in(grammar, special_texts)),
                       "response_format.choice")
    if kind == "grammar":
        try:
            grammar = to_xgrammar_ebnf(_text(body, "grammar"))
        except GrammarError as exc:
            raise _bad(f"response_format.grammar: {exc}", "response_format.grammar") from None
        return checked(GuidedDecoding(kind="grammar", value=grammar,
                                      special_tokens=_specials_in(grammar, special_texts)),
                       "response_format.grammar")
    if kind == "structural_tag":
        value = structural_tag_value(body.get("structural_tag"))
        return checked(GuidedDecoding(kind="structural_tag", value=value,
                                      special_tokens=_specials_in(value, special_texts)),
                       "response_format.structural_tag")
    raise _bad(f"response_format.type {kind!r} is not supported (one of {', '.join(KINDS)})",
               "response_format.type")
