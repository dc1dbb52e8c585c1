"""Response validation: against the official OpenAI OpenAPI document (the independent reference)
and against our own spec (so the spec we serve describes what we send).

The official document mixes OpenAPI 3.0's `nullable: true` with 3.1's `type: "null"`; here every
schema with `nullable: true` also accepts null. Schemas are looked up by name under
`components/schemas`.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

OFFICIAL_SPEC = Path("/work/shared/reference/openai-openapi.json")
OUR_SPEC = Path(__file__).resolve().parents[2] / "openapi" / "flotilla.yaml"
_URI = "urn:openai:openapi"
_OUR_URI = "urn:flotilla:openapi"


def _allow_null(node: Any) -> Any:
    if isinstance(node, list):
        return [_allow_null(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _allow_null(v) for k, v in node.items()}
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _registry() -> Registry:
    document = _allow_null(json.loads(OFFICIAL_SPEC.read_text()))
    return Registry().with_resource(
        _URI, Resource.from_contents(document, default_specification=DRAFT202012))


@functools.cache
def _validator(schema_name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"{_URI}#/components/schemas/{schema_name}"},
                                registry=_registry())


def validate_openai(schema_name: str, instance: Any) -> None:
    """Raise AssertionError listing every violation of the official schema."""
    errors = list(_validator(schema_name).iter_errors(instance))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
                 for e in errors]
        raise AssertionError(f"not a valid {schema_name}:\n" + "\n".join(lines)
                             + f"\ninstance: {json.dumps(instance)[:2000]}")


def validate_completion_chunk(chunk: dict[str, Any]) -> None:
    """A streamed text_completion chunk against CreateCompletionResponse. OpenAI (and vLLM) send
    `finish_reason: null` on a choice's non-final chunks although that schema has no null; we
    check such a chunk with the one field relaxed and everything else as published."""
    relaxed = copy.deepcopy(chunk)
    for choice in relaxed.get("choices", []):
        if choice.get("finish_reason") is None:
            choice["finish_reason"] = "stop"
    validate_completion(relaxed)


def validate_completion(body: dict[str, Any]) -> None:
    """A text_completion against CreateCompletionResponse. With `echo` and `logprobs` OpenAI's
    legacy API (and vLLM) answer `null` as the first prompt token's `token_logprobs` and
    `top_logprobs` entries (nothing precedes it), although the schema says number / object;
    only such a leading null is relaxed (to 0.0 / {}), everything else is checked as
    published."""
    relaxed = copy.deepcopy(body)
    for choice in relaxed.get("choices", []):
        logprobs = choice.get("logprobs") or {}
        for key, filler in (("token_logprobs", 0.0), ("top_logprobs", {})):
            values = logprobs.get(key) or []
            if values and values[0] is None:
                values[0] = filler
    validate_openai("CreateCompletionResponse", relaxed)


@functools.cache
def _our_validator(schema_name: str) -> Draft202012Validator:
    document = yaml.safe_load(OUR_SPEC.read_text())
    registry: Registry = Registry().with_resource(
        _OUR_URI, Resource.from_contents(document, default_specification=DRAFT202012))
    return Draft202012Validator({"$ref": f"{_OUR_URI}#/components/schemas/{schema_name}"},
                                registry=registry)


def validate_ours(schema_name: str, instance: Any) -> None:
    errors = list(_our_validator(schema_name).iter_errors(instance))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
                 for e in errors]
        raise AssertionError(f"not a valid flotilla {schema_name}:\n" + "\n".join(lines))
