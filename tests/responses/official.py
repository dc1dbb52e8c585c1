"""Responses stream events checked against OpenAI's own schema for their type (the official
document's `ResponseStreamEvent` is a union of ~60 event schemas; validating against the union
reports nothing useful, so each event is checked against the member its `type` names)."""

from __future__ import annotations

import functools
import json
from typing import Any

from tests.gateway.schemas import OFFICIAL_SPEC, validate_openai


@functools.cache
def _event_schemas() -> dict[str, str]:
    schemas = json.loads(OFFICIAL_SPEC.read_text())["components"]["schemas"]
    union = schemas["ResponseStreamEvent"]
    out = {}
    for member in union.get("anyOf") or union.get("oneOf"):
        name = member["$ref"].rsplit("/", 1)[1]
        for kind in schemas[name]["properties"]["type"].get("enum", []):
            out[kind] = name
    return out


def validate_event(event: dict[str, Any]) -> None:
    name = _event_schemas().get(event["type"])
    assert name is not None, f"{event['type']} is not an event of OpenAI's Responses stream"
    validate_openai(name, event)
    validate_openai("ResponseStreamEvent", event)
