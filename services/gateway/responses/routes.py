"""HTTP handlers of OpenAI's Responses API: validate → translate (request.py, items.py) → run
(run.py: the turns and the MCP agent loop) → the response object, its SSE events, or a
background run; plus the stored responses' GET / DELETE / input_items / cancel.

Rules:
- Bodies are validated against the spec; errors use OpenAI's envelope (the app's handlers).
- The first turn is admitted before anything is sent, so a refusal (context length, unknown
  tool choice, no tokenizer) is an HTTP error, as on chat completions; later failures are a
  `failed` response (`error` + `response.failed` events when streaming).
- A client that leaves a non-background request cancels its run (saved as `cancelled`).
- `background` needs `store` (a run nobody can read back is useless) and is not streamed.
- Stream events are `event: <type>` + `data: <json>`, with no `[DONE]` (as OpenAI sends).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common.errors import FlotillaError, envelope, invalid_request
from flotilla.libs.common.messages import ErrorInfo
from flotilla.services.gateway.conversations.store import ConversationStore
from flotilla.services.gateway.mcp import McpToolset, requested_toolset
from flotilla.services.gateway.request_body import validated_body
from flotilla.services.gateway.responses.background import BackgroundRuns
from flotilla.services.gateway.responses.items import input_items
from flotilla.services.gateway.responses.request import (
    ResponseRequest,
    response_object,
    response_request,
)
from flotilla.services.gateway.responses.run import ResponseRun
from flotilla.services.gateway.responses.store import ResponseStore
from flotilla.services.gateway.routes import CLIENT_CLOSED, ClientGone, unless_disconnected
from flotilla.services.gateway.sse import EventStream
from flotilla.services.gateway.streams import ChoiceStreams

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState

router = APIRouter()


@dataclass
class ResponsesState:
    store: ResponseStore
    background: BackgroundRuns


def install(app: FastAPI) -> None:
    """Add the Responses routes and their state (`app.state.responses`) to the gateway app."""
    gw: GatewayState = app.state.gateway
    store = ResponseStore(gw.store, gw.settings.responses_ttl_s)
    app.state.responses = ResponsesState(store, BackgroundRuns(store))
    app.include_router(router)


def _state(request: Request) -> tuple[GatewayState, ResponsesState]:
    return request.app.state.gateway, request.app.state.responses


def not_found(response_id: str, param: str | None = None) -> FlotillaError:
    return FlotillaError(ErrorInfo(status=404, type="invalid_request_error", param=param,
                                   code="not_found",
                                   message=f"Response with id '{response_id}' not found."))


def event_bytes(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _sse(run: ResponseRun) -> AsyncIterator[bytes]:
    try:
        async for event in run.events():
            yield event_bytes(event)
    except FlotillaError as exc:  # the store failed at the very end: say so, the stream is sent
        yield b"data: " + orjson.dumps(envelope(exc.info)) + b"\n\n"


async def _history(request: Request, rs: ResponsesState, req: ResponseRequest,
                   items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items before the request's `input`: its conversation's, or its previous
    response's chain (a conversation must have room for `items`)."""
    body = req.body
    if req.conversation is not None:
        if body.get("previous_response_id") is not None:
            raise invalid_request("Mutually exclusive parameters: provide only one of "
                                  "`previous_response_id` or `conversation`.",
                                  param="conversation")
        conversations: ConversationStore = request.app.state.conversations
        history = (await conversations.get(req.conversation, "conversation"))["items"]
        conversations.check(history + items, "conversation")
        return list(history)
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    record = await rs.store.get(previous)
    if record is None:
        raise not_found(previous, param="previous_response_id")
    return list(record["history"])


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    gw, rs = _state(request)
    body = await validated_body(request, "createResponse")
    req = response_request(body)
    if req.background and not req.store:
        raise invalid_request("`background` responses need `store: true`.", param="background")
    if req.background and req.stream:
        raise invalid_request("Streaming a `background` response is not supported by this "
                              "server; poll `GET /v1/responses/{id}` instead.", param="stream")
    await gw.require_model(body["model"], "generate")
    items = input_items(body["input"])
    history = await _history(request, rs, req, items)
    mcp = McpToolset()
    if any(t["type"] == "mcp" for t in body.get("tools") or []):
        mcp = requested_toolset(body["tools"], await gw.tools.listing())
    run = ResponseRun(gw, req, response_object(req), history, items, mcp, rs.store,
                      request.app.state.conversations)
    if req.background:
        await rs.store.save(run.response, run.input_items, [])
        rs.background.start(run)
        return JSONResponse(copy.deepcopy(run.response))
    idle = ChoiceStreams(gw.bus, [], 0, 0)  # the run cancels its own turns (run.cancel)
    try:
        await unless_disconnected(request, run.prepare(), idle)
    except ClientGone:
        run.cancel()
        return Response(status_code=CLIENT_CLOSED)
    if req.stream:
        return EventStream(_sse(run), on_disconnect=run.cancel, on_close=lambda: None)
    try:
        response = await unless_disconnected(request, run.collect(), idle)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(response)


async def _record(rs: ResponsesState, response_id: str) -> dict[str, Any]:
    record = await rs.store.get(response_id)
    if record is None:
        raise not_found(response_id)
    live = rs.background.runs.get(response_id)
    if live is not None:  # running here: its current state, fresher than the stored one
        record["response"] = copy.deepcopy(live.response)
    return record


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    _, rs = _state(request)
    if request.query_params.get("stream") in ("true", "1"):
        raise invalid_request("Resuming a response stream is not supported by this server.",
                              param="stream")
    return JSONResponse((await _record(rs, response_id))["response"])


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    _, rs = _state(request)
    await rs.background.cancel(response_id)
    if not await rs.store.delete(response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str) -> Response:
    _, rs = _state(request)
    items = (await _record(rs, response_id))["input_items"]
    query = request.query_params
    if query.get("order", "desc") == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    try:
        limit = min(max(int(query.get("limit", 20)), 1), 100)
    except ValueError as exc:
        raise invalid_request("`limit` must be an integer from 1 to 100.", param="limit") from exc
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "has_more": len(items) > limit,
                         "first_id": page[0]["id"] if page else "",
                         "last_id": page[-1]["id"] if page else ""})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    _, rs = _state(request)
    record = await _record(rs, response_id)
    response = record["response"]
    if not response.get("background"):
        raise invalid_request("Only background responses can be cancelled.")
    if response["status"] in ("queued", "in_progress"):
        if not await rs.background.cancel(response_id):
            await rs.store.request_cancel(response_id)  # another gateway process runs it
            response["status"] = "cancelled"
        else:
            response = (await _record(rs, response_id))["response"]
    return JSONResponse(response)
