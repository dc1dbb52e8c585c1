"""Anthropic's objects checked with the `anthropic` SDK's own types (the reference for this
API), strictly: parsed from JSON in pydantic's strict mode, and no field the types do not know
(the SDK's models allow extras; an unknown field would pass unnoticed otherwise)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, TypeAdapter


def _extras(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        found = [f"{path}.{k}" for k in (value.model_extra or {})]
        for name in type(value).model_fields:
            found += _extras(getattr(value, name), f"{path}.{name}")
        return found
    if isinstance(value, list):
        return [e for i, v in enumerate(value) for e in _extras(v, f"{path}[{i}]")]
    return []


def strict(kind: Any, data: Any) -> Any:
    """`data` parsed as the SDK type `kind`; AssertionError naming any unknown field."""
    parsed = TypeAdapter(kind).validate_json(json.dumps(data), strict=True)
    extras = _extras(parsed, "<root>")
    assert not extras, f"fields the anthropic SDK does not know: {extras} in {data}"
    return parsed


def stream_event(data: dict[str, Any]) -> Any:
    """One SSE payload of a Messages stream: ping, error, or a RawMessageStreamEvent."""
    import anthropic.types as t

    if data["type"] == "ping":
        assert data == {"type": "ping"}
        return data
    if data["type"] == "error":
        return strict(t.ErrorResponse, data)
    return strict(t.RawMessageStreamEvent, data)
