"""HTTP handlers of Anthropic's Messages API: validate → translate into a chat body → one turn on
the bus (as /v1/chat/completions runs it) → Anthropic's message or stream events.

Rules:
- Bodies are validated against the spec's Anthropic schemas; every error, before or during the
  stream, is in Anthropic's envelope (errors.py). The auth and version headers are accepted.
- A client that leaves (streaming or not) gets its turn cancelled, as on the chat routes.
- `count_tokens` renders the prompt exactly as `/v1/messages` would (template, tools) and counts
  its tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common import subjects
from flotilla.libs.common.errors import FlotillaError, internal, invalid_request
from flotilla.libs.common.messages import RenderReply
from flotilla.services.gateway.anthropic.errors import AnthropicRoute
from flotilla.services.gateway.anthropic.events import MessageEvents
from flotilla.services.gateway.anthropic.message import message
from flotilla.services.gateway.anthropic.translate import chat_shape
from flotilla.services.gateway.plan import new_request_id
from flotilla.services.gateway.request_body import gateway, model_request
from flotilla.services.gateway.routes import CLIENT_CLOSED, ClientGone, unless_disconnected
from flotilla.services.gateway.sse import EventStream
from flotilla.services.gateway.turns import Turn, new_turn, turn_request

router = APIRouter(route_class=AnthropicRoute)


async def _events(turn: Turn, events: MessageEvents) -> AsyncIterator[bytes]:
    try:
        for chunk in events.start():
            yield chunk
        async for delta in turn.deltas():
            for chunk in events.delta(delta):
                yield chunk
        if turn.result.final is None:
            raise internal("the reply ended without its final frame")
        for chunk in events.final(turn.result.final):
            yield chunk
    except FlotillaError as exc:
        yield events.error(exc.info)
    finally:
        turn.close()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    gw = gateway(request)
    body, _ = await model_request(request, "createMessage", "generate")
    shape = chat_shape(body)
    rid = new_request_id()
    turn = new_turn(gw, shape.body, shape.tools, rid, shape.extra)
    try:
        await unless_disconnected(request, turn.start(), turn.streams)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if body.get("stream"):
        return EventStream(_events(turn, MessageEvents(rid, body["model"])),
                           on_disconnect=turn.cancel, on_close=turn.close)
    try:
        result = await unless_disconnected(request, turn.run(), turn.streams)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        turn.close()
    if result.final is None:
        raise internal("the reply ended without its final frame")
    return JSONResponse(message(rid, body["model"], result))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    gw = gateway(request)
    body, _ = await model_request(request, "countMessageTokens")
    shape = chat_shape(body)
    req = turn_request(gw, shape.body, shape.tools, new_request_id(), shape.extra)
    reply = await gw.bus.request(subjects.tokenizer_render(body["model"]), req, RenderReply,
                                 timeout=gw.settings.request_timeout_s)
    if reply.error is not None:
        raise FlotillaError(reply.error)
    return JSONResponse({"input_tokens": len(reply.token_ids)})


@router.api_route("/v1/messages/{rest:path}",
                  methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def unknown(request: Request, rest: str) -> Response:
    """Other Messages API URLs (batches, ...) answer 404 in Anthropic's envelope."""
    error = invalid_request(f"Unknown URL: {request.method} {request.url.path}")
    error.info.status = 404
    raise error
