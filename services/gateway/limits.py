"""Bounds on what one request body may hold, checked before the work it would cause.

Rules:
- The body is read from the ASGI stream with a cap (`max_body_bytes`): a Content-Length above
  the cap is answered 413 before any byte is read; a body without one (chunked) is read up to the
  cap, then 413. Nothing buffers more than the cap. (Headers are bounded earlier, while uvicorn
  parses them: http_protocol.py.)
- JSON is parsed by orjson. Its parser stops at 1,024 levels (no recursion can blow up) and
  refuses what is not UTF-8 text, a lone UTF-16 surrogate such as `"\\ud800"` included: such a
  string cannot be encoded as UTF-8 on the bus or tokenized, so it is a 400 at the door, never a
  failure further down.
- One walk over the parsed body, without recursion, then (a) refuses nesting deeper than
  `max_json_depth` and (b) turns integer-valued floats below 2^63 (`2.0`, `1e3`) into ints: JSON
  Schema calls them integers, so the spec accepts them where it asks for an integer, and every
  later step sees one type (`"prompt": [1, 2.0]` is the token-id prompt [1, 2]). orjson reads
  integers past 64 bits as (rounded) floats: a body with a number of 2^63 or more is read again
  by the standard library, exactly (so `-2^63 - 1` stays out of the seed's range), and such
  numbers stay what they are; the spec's bounds refuse them wherever an integer is expected.
- After schema validation, `check_schema_sizes` bounds what the schema cannot: the serialized
  size of each tool's function and of `response_format` (`max_schema_bytes`), 400 naming it.
Counts (messages, tools, stop strings, prompts, n) are bounds in the spec itself, filled in
from the settings when the spec is loaded (spec.py).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.requests import Request

from flotilla.libs.common.errors import invalid_request, too_large
from flotilla.libs.common.settings import GatewaySettings

_INT64_LIMIT = float(2**63)
SPEC_LIMITS = ("max_n", "max_messages", "max_tools", "max_stop", "max_stop_chars", "max_prompts",
               "max_embedding_inputs")


def spec_limits(settings: GatewaySettings) -> dict[str, int]:
    """The settings the spec's `x-limit` keywords name, with this server's values."""
    return {name: int(getattr(settings, name)) for name in SPEC_LIMITS}


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _body_too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _body_too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _body_too_large(size: int, max_bytes: int) -> Exception:
    return too_large(f"The request body is larger than this server's limit of {max_bytes:,} "
                     f"bytes (at least {size:,} bytes were sent).")


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The parsed body (see the module rules); 400 for bad JSON, bad text or deep nesting."""
    if not raw.strip():
        raise invalid_request("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
        if "depth limit" in reason or "recursion limit" in reason:
            raise _too_deep(max_depth) from None
        if "surrogate" in reason:
            raise invalid_request(
                "The request body holds a lone UTF-16 surrogate escape (such as \\ud800) or "
                f"bytes that are not UTF-8 ({reason}); strings must be valid Unicode text."
            ) from None
        raise invalid_request(f"The request body is not valid JSON: {reason}.") from None
    if _normalize(body, max_depth):  # a number orjson may have rounded: read it exactly
        try:
            body = json.loads(raw)
        except RecursionError:
            raise _too_deep(max_depth) from None
        _normalize(body, max_depth)
    return body


def _too_deep(max_depth: int) -> Exception:
    return invalid_request(f"The request body is nested deeper than this server's limit of "
                           f"{max_depth} levels.", code="json_too_deep")


def _integer_valued(value: float) -> bool:
    return value.is_integer() and abs(value) < _INT64_LIMIT


def _normalize(body: Any, max_depth: int) -> bool:
    """Depth check and integer-valued floats → ints, in place (see the module rules); whether
    a float of 2^63 or more was seen."""
    huge = False
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth)
        if isinstance(node, dict):
            for key, value in node.items():
                kind = type(value)
                if kind is dict or kind is list:
                    stack.append((value, depth + 1))
                elif kind is float:
                    if _integer_valued(value):
                        node[key] = int(value)
                    elif abs(value) >= _INT64_LIMIT:
                        huge = True
        elif isinstance(node, list):
            for i, value in enumerate(node):
                kind = type(value)
                if kind is dict or kind is list:
                    stack.append((value, depth + 1))
                elif kind is float:
                    if _integer_valued(value):
                        node[i] = int(value)
                    elif abs(value) >= _INT64_LIMIT:
                        huge = True
    return huge


def _json_size(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except TypeError:  # not JSON-serialisable by orjson (cannot come from a parsed body)
        return 0


def check_schema_sizes(body: dict[str, Any], max_schema_bytes: int) -> None:
    """400 naming the first tool function or response_format larger than `max_schema_bytes`."""
    for i, tool in enumerate(body.get("tools") or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if function is not None and _json_size(function) > max_schema_bytes:
            raise _schema_too_large(f"tools[{i}].function", max_schema_bytes)
    fmt = body.get("response_format")
    if fmt is not None and _json_size(fmt) > max_schema_bytes:
        raise _schema_too_large("response_format", max_schema_bytes)


def _schema_too_large(param: str, max_schema_bytes: int) -> Exception:
    return invalid_request(f"`{param}` is larger than this server's limit of "
                           f"{max_schema_bytes:,} bytes of JSON.", param=param,
                           code="schema_too_large")
