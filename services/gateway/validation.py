"""JSON Schema validation errors → one human message naming the offending parameter.

Rules:
- `param` is the dotted/indexed path of the offending value (`messages[0].role`), or None for the
  body itself; the message names it in backticks.
- Of several errors one with an `x-error-message` wins, else the shallowest (it says the most);
  inside `anyOf`/`oneOf` we descend into the branch whose type matched the value, since only
  that branch's complaint is relevant.
- A schema may carry `x-error-message` (our spec extension) to replace the generic text of its
  failing keyword (not for `additionalProperties` or `required`, which are always precise).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from jsonschema.exceptions import ValidationError, relevance

from flotilla.libs.common.errors import FlotillaError, invalid_request

_TYPE_NAMES = {"string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "a boolean", "array": "an array", "object": "an object", "null": "null"}
_PRECISE = {"additionalProperties", "required"}


def param_path(path: Iterable[str | int]) -> str | None:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _custom(error: ValidationError) -> str | None:
    if error.validator in _PRECISE or not isinstance(error.schema, dict):
        return None
    message = error.schema.get("x-error-message")
    return str(message).strip() if message else None


def pick(errors: Sequence[ValidationError]) -> ValidationError:
    """The error that best explains what is wrong (see the module rules)."""
    best = max(errors, key=lambda e: (_custom(e) is not None, relevance(e)))
    while best.validator in ("anyOf", "oneOf") and best.context:
        # Branches that merely had the wrong type (or shape) say nothing about the value.
        candidates = [e for e in best.context
                      if not (e.validator in ("type", "required") and not e.relative_path)]
        if not candidates or all(e.validator == "type" for e in candidates):
            break
        # A type error inside a branch (an item of the wrong kind) says the value is of
        # another branch's shape; the other errors say what is wrong with it.
        precise = [e for e in candidates if e.validator != "type"] or candidates
        if len({e.relative_schema_path[0] for e in precise}) > 1 and _custom(best):
            break  # the value fits several branches' shapes: the schema's own words say it
        best = min(precise, key=relevance)
    return best


def _child(error: ValidationError, name: str) -> str:
    return param_path([*error.absolute_path, name]) or name


def message_for(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) for one validation error."""
    param = param_path(error.absolute_path)
    where = f"`{param}`" if param else "the request body"
    value, kw, limit = error.instance, error.validator, error.validator_value
    if kw == "additionalProperties":
        allowed = set(error.schema.get("properties", {}))
        extra = [k for k in value if k not in allowed] if isinstance(value, dict) else []
        names = [_child(error, k) for k in extra] or [param or "parameter"]
        verb = "is" if len(names) == 1 else "are"
        listed = ", ".join(f"`{n}`" for n in names)
        return f"{listed} {verb} not supported by this server.", names[0]
    if kw == "required":
        missing = [k for k in limit if not (isinstance(value, dict) and k in value)]
        name = _child(error, missing[0] if missing else "?")
        return f"Missing required parameter: `{name}`.", name
    custom = _custom(error)
    if custom:
        return custom.replace("{param}", param or "body").replace("{value}", _show(value)), param
    if kw == "type":
        kinds = [limit] if isinstance(limit, str) else list(limit)
        expected = " or ".join(_TYPE_NAMES.get(k, k) for k in kinds)
        return (f"Invalid type for {where}: expected {expected}, but got {json_type(value)}.",
                param)
    if kw in ("anyOf", "oneOf"):
        kinds = [b.get("type") for b in limit if isinstance(b, dict) and "type" in b]
        flat = [k for t in kinds for k in ([t] if isinstance(t, str) else t)]
        if flat and len(flat) == len(limit):
            expected = " or ".join(dict.fromkeys(_TYPE_NAMES.get(k, k) for k in flat))
            return f"Invalid type for {where}: expected {expected}, but got {json_type(value)}.", \
                param
        return f"Invalid value for {where}: {_show(value)}.", param
    if kw in ("enum", "const"):
        options = limit if kw == "enum" else [limit]
        supported = ", ".join(_show(o) for o in options)
        return (f"Invalid value for {where}: {_show(value)}. Supported values are: {supported}.",
                param)
    bounds = {
        "minimum": f"{_show(value)} is below the minimum of {limit}",
        "maximum": f"{_show(value)} is above the maximum of {limit}",
        "exclusiveMinimum": f"{_show(value)} must be greater than {limit}",
        "exclusiveMaximum": f"{_show(value)} must be less than {limit}",
        "minItems": f"expected at least {limit} item(s), got {_len(value)}",
        "maxItems": f"expected at most {limit} item(s), got {_len(value)}",
        "minLength": f"expected at least {limit} character(s), got {_len(value)}",
        "maxLength": f"expected at most {limit} character(s), got {_len(value)}",
        "pattern": f"{_show(value)} does not match the pattern {limit}",
    }
    if kw in bounds:
        return f"Invalid value for {where}: {bounds[kw]}.", param
    return f"Invalid value for {where}: {error.message}.", param


def _len(value: Any) -> int:
    return len(value) if hasattr(value, "__len__") else 0


def describe(errors: Sequence[ValidationError]) -> FlotillaError:
    message, param = message_for(pick(errors))
    return invalid_request(message, param=param)


_COMPILED_BOUNDS = {
    "MaxItems": "expected at most {limit} item(s), got {size}",
    "MinItems": "expected at least {limit} item(s), got {size}",
    "MaxLength": "expected at most {limit} character(s), got {size}",
    "MinLength": "expected at least {limit} character(s), got {size}",
    "Maximum": "{value} is above the maximum of {limit}",
    "Minimum": "{value} is below the minimum of {limit}",
    "ExclusiveMaximum": "{value} must be less than {limit}",
    "ExclusiveMinimum": "{value} must be greater than {limit}",
}


def describe_compiled(error: Any, instance: Any, schema: Any) -> FlotillaError:
    """The 400 for a compiled validator's (jsonschema_rs) error, in the same words as
    `message_for`: `instance` is the refused value, `schema` the subschema that refused it."""
    param = param_path(error.instance_path)
    where = f"`{param}`" if param else "the request body"
    kind = type(error.kind).__name__
    if kind == "AdditionalProperties":
        names = [param_path([*error.instance_path, k]) or k for k in error.kind.unexpected]
        listed = ", ".join(f"`{n}`" for n in names)
        verb = "is" if len(names) == 1 else "are"
        return invalid_request(f"{listed} {verb} not supported by this server.",
                               param=names[0] if names else param)
    if kind == "Required":
        name = param_path([*error.instance_path, error.kind.property]) or "?"
        return invalid_request(f"Missing required parameter: `{name}`.", param=name)
    custom = schema.get("x-error-message") if isinstance(schema, dict) else None
    if custom:
        text = str(custom).strip().replace("{param}", param or "body")
        return invalid_request(text.replace("{value}", _show(instance)), param=param)
    if kind == "Type":
        kinds = [str(getattr(t, "name", t)).lower() for t in error.kind.types]
        expected = " or ".join(_TYPE_NAMES.get(k, k) for k in kinds)
        return invalid_request(f"Invalid type for {where}: expected {expected}, but got "
                               f"{json_type(instance)}.", param=param)
    if kind in _COMPILED_BOUNDS:
        bound = _COMPILED_BOUNDS[kind].format(limit=error.kind.limit, size=_len(instance),
                                              value=_show(instance))
        return invalid_request(f"Invalid value for {where}: {bound}.", param=param)
    return invalid_request(f"Invalid value for {where}.", param=param)
