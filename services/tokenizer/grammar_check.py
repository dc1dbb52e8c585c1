"""The grammar engine's side of structured outputs: xgrammar, the one conversion of a spec
into an xgrammar Grammar (`grammar_of`; the engine compiles the very same, in
services/engine/structured.py), and the checks every spec passes before admission.

Rules:
- `checked(spec, param)`: xgrammar builds the spec's grammar, or the request gets a 400 naming
  `param` with xgrammar's reason.
- `check_schema(schema, param)`: a JSON schema is refused (400, `param` names it) when it is not
  an object, exceeds MAX_SCHEMA_CHARS or MAX_DEPTH, has a size bound (maxLength, maxItems, ...)
  above MAX_BOUND, breaks the JSON Schema 2020-12 metaschema, or uses a keyword xgrammar cannot
  enforce (schema_rules.py, which also rewrites what it can); it returns the schema to compile.
- xgrammar is imported by `xgrammar()`, which each service's warm-up calls before it serves
  (the import takes seconds).
"""

from __future__ import annotations

import functools
import importlib
import json
from types import ModuleType
from typing import TYPE_CHECKING, Any

import jsonschema_rs
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from flotilla.libs.common.errors import FlotillaError, invalid_request
from flotilla.libs.common.messages import GuidedDecoding
from flotilla.services.tokenizer.schema_rules import enforceable

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
    """The xgrammar module (imported by the services' warm-up, before they serve: seconds)."""
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
    if spec.kind == "regex":
        return grammar.from_regex(value)
    return grammar.from_ebnf(value)


@functools.cache
def _metaschema() -> jsonschema_rs.Validator:
    """The JSON Schema 2020-12 metaschema (formats checked, as jsonschema's check_schema does),
    compiled: it answers "valid"; jsonschema decides every refusal and words it."""
    return jsonschema_rs.Draft202012Validator(Draft202012Validator.META_SCHEMA,
                                              validate_formats=True)


def bad_schema(message: str, param: str) -> FlotillaError:
    return invalid_request(message, param=param, code="invalid_json_schema")


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """The schema to compile (schema_rules.py's rewrite), or a 400 naming `param` (see module
    rules)."""
    if not isinstance(schema, dict):
        raise bad_schema(f"{param} must be a JSON Schema object", param)
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise bad_schema(f"{param} is too large ({len(text)} characters; at most "
                         f"{MAX_SCHEMA_CHARS})", param)
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_schema(f"{param} is nested too deeply (at most {MAX_DEPTH} levels)", param)
        if isinstance(node, dict):
            for key in _BOUNDS:
                bound = node.get(key)
                if isinstance(bound, int | float) and bound > MAX_BOUND:
                    raise bad_schema(f"{param}: {key} {bound} is above this server's limit of "
                                     f"{MAX_BOUND}", param)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    if not _metaschema().is_valid(schema):  # ~10 us; jsonschema's own check takes ~5 ms
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            raise bad_schema(f"{param} is not a valid JSON Schema: {exc.message}", param) from None
    return enforceable(schema, param)


def checked(spec: GuidedDecoding, param: str) -> GuidedDecoding:
    """`spec` once xgrammar has built its grammar, or a 400 naming `param`."""
    try:
        grammar_of(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        code = "invalid_json_schema" if spec.kind in ("json_schema", "structural_tag") else (
            "invalid_grammar")
        raise invalid_request(f"{param} cannot be used for structured output: {reason}",
                              param=param, code=code) from None
    return spec
