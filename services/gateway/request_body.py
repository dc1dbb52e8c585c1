"""The preamble every POST route shares: read the body, validate it, find its model.

Rules:
- `validated_body(request, operation)`: the body read with a cap and before the request's
  deadline, parsed with a depth bound (limits.py), a keyed request's allowlist and token
  reservation checked (key_usage.py), then validated against `operation`'s schema in the spec
  (its operationId); with `schema_sizes`, the JSON schemas inside it (response formats, tools)
  within their size cap. In that order: the first failure is the error the client sees.
- `model_request(request, operation, serves)`: the same, then the model: `model` from the body,
  or, left out (vLLM makes it optional on some routes), the one model served; 404 for an
  unknown one, 400 naming `model` where it cannot serve `serves` (app.py `require_model`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request

from flotilla.libs.common.deadline import Deadline
from flotilla.libs.common.errors import invalid_request
from flotilla.libs.common.model_capabilities import Capability
from flotilla.services.gateway.key_usage import CURRENT as KEY_USAGE
from flotilla.services.gateway.key_usage import check_body
from flotilla.services.gateway.limits import check_schema_sizes, parse_json, read_body
from flotilla.services.gateway.overload import request_timeout
from flotilla.services.gateway.registry import ModelInfo

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState


def gateway(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


def request_deadline(request: Request) -> Deadline:
    """When this request must be finished: `X-Request-Timeout`, else the server's default."""
    return Deadline.after(request_timeout(request.headers, gateway(request).settings))


async def read_json(request: Request, deadline: Deadline | None = None) -> Any:
    """The parsed body, within the size and depth limits; a body still arriving when the
    request's deadline (by default its own: `request_deadline`) passes is a 504. A keyed
    request's allowlist and token reservation are checked here (key_usage.py)."""
    settings = gateway(request).settings
    deadline = deadline or request_deadline(request)
    try:
        async with asyncio.timeout(deadline.remaining()):
            raw = await read_body(request, settings.max_body_bytes)
    except TimeoutError:
        raise deadline.error() from None
    body = parse_json(raw, settings.max_json_depth)
    if KEY_USAGE.get() is not None:
        await check_body(request.url.path, body, len(raw), settings.key_reserve_output_tokens)
    return body


async def validated_body(
    request: Request,
    operation: str,
    deadline: Deadline | None = None,
    schema_sizes: bool = False,
) -> Any:
    """The body of an `operation` request (see the module rules)."""
    gw = gateway(request)
    body = await read_json(request, deadline)
    gw.spec.validate(operation, body)
    if schema_sizes:
        check_schema_sizes(body, gw.settings.max_schema_bytes)
    return body


async def served_model(
    gw: GatewayState, body: dict[str, Any], serves: Capability | None = None
) -> ModelInfo:
    """The body's model, or the one model served when it names none (see the module rules)."""
    if body.get("model") is not None:
        return await gw.require_model(body["model"], serves)
    models = await gw.registry.models()
    if len(models) != 1:
        raise invalid_request(
            f"Missing required parameter: `model` (this server serves {len(models)} models).",
            param="model",
        )
    return await gw.require_model(models[0].id, serves)


async def model_request(
    request: Request,
    operation: str,
    serves: Capability | None = None,
    deadline: Deadline | None = None,
    schema_sizes: bool = False,
) -> tuple[Any, ModelInfo]:
    """The validated body of an `operation` request and its model (see the module rules)."""
    body = await validated_body(request, operation, deadline, schema_sizes)
    return body, await served_model(gateway(request), body, serves)
