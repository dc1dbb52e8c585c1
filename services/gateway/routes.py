"""HTTP handlers: decode → validate against the spec → plan → run on the bus → encode.

Rules:
- Every body is validated against the operation's schema in the spec before anything else.
- Errors before the first response byte (bad input, unknown model, refused admission, no
  tokenizer) are HTTP errors in the envelope; a stream that fails later ends with an error event.
- A client that goes away (streaming or not, even during admission) gets its choices cancelled.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from libs.common import subjects
from libs.common.errors import FlotillaError, internal, invalid_request
from libs.common.messages import RenderReply, TextRequest
from services.gateway.chunks import chunk_builder
from services.gateway.plan import (
    Plan,
    chat_plan,
    completion_plan,
    new_request_id,
    normalize_message,
)
from services.gateway.results import chat_completion, collect, text_completion
from services.gateway.sse import EventStream, sse_events
from services.gateway.streams import ChoiceStreams

if TYPE_CHECKING:
    from services.gateway.app import GatewayState

router = APIRouter()
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do


class ClientGone(Exception):
    pass


def _gateway(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


async def read_json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise invalid_request("The request body is empty; expected a JSON object.")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}.") from exc


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T], streams: ChoiceStreams) -> T:
    """Await `work` in this task; if the client disconnects first, cancel it and the choices and
    raise ClientGone. (In this task, not a new one: a new task goes to the back of the event
    loop's ready queue, so in a burst every request would reach the bus only after all of them
    had been parsed and validated.)"""
    task = asyncio.current_task()
    assert task is not None
    watching = True

    def on_disconnect(watcher: asyncio.Task[None]) -> None:
        if not watcher.cancelled():
            watcher.exception()  # retrieved: a failed receive counts as the client gone
            if watching:
                task.cancel()

    watcher = asyncio.ensure_future(_until_disconnect(request))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise  # cancelled from elsewhere (shutdown)
        task.uncancel()  # our own cancellation, turned into ClientGone
        streams.cancel("client_disconnect")
        streams.close()
        raise ClientGone() from None
    finally:
        watching = False
        watcher.cancel()


async def generate(request: Request, plan: Plan) -> Response:
    gw = _gateway(request)
    streams = ChoiceStreams(gw.bus, plan.requests,
                            admission_timeout_s=gw.settings.request_timeout_s,
                            stream_timeout_s=gw.settings.heartbeat_timeout_s)
    created = int(time.time())
    try:
        await unless_disconnected(request, streams.start(), streams)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if plan.stream:
        events = sse_events(streams, chunk_builder(plan, created), plan.include_usage)
        return EventStream(events, on_disconnect=streams.cancel, on_close=streams.close)
    try:
        results = await unless_disconnected(request, collect(streams), streams)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        streams.close()
    if any(r.final is None for r in results):
        raise internal("a choice ended without its final frame")
    build = chat_completion if plan.kind == "chat" else text_completion
    return JSONResponse(build(plan, results, created))


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    gw = _gateway(request)
    body = await read_json(request)
    gw.spec.validate("createChatCompletion", body)
    await gw.require_model(body["model"])
    tools = await gw.tools.tools_for(body)
    return await generate(request, chat_plan(body, tools, gw.settings.max_n,
                                             reasoning_field=gw.settings.reasoning_field))


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    gw = _gateway(request)
    body = await read_json(request)
    gw.spec.validate("createCompletion", body)
    await gw.require_model(body["model"])
    return await generate(request, completion_plan(body, gw.settings.max_n))


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    gw = _gateway(request)
    body = await read_json(request)
    gw.spec.validate("tokenize", body)
    info = await gw.require_model(body["model"])
    rid = new_request_id()
    common: dict[str, Any] = {"request_id": rid, "model": body["model"],
                              "stream_subject": subjects.text_stream(rid)}
    if "messages" in body:
        req = TextRequest(
            kind="chat", messages=[normalize_message(m) for m in body["messages"]],
            tools=await gw.tools.tools_for(body),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            chat_template_kwargs=body.get("chat_template_kwargs"), **common)
    else:
        req = TextRequest(kind="completion", prompt=body["prompt"], **common)
    reply = await gw.bus.request(subjects.tokenizer_render(body["model"]), req, RenderReply,
                                 timeout=gw.settings.request_timeout_s)
    if reply.error is not None:
        raise FlotillaError(reply.error)
    return JSONResponse({"model": body["model"], "prompt": reply.prompt,
                         "tokens": reply.token_ids, "count": len(reply.token_ids),
                         "max_model_len": reply.max_model_len or info.max_model_len or 0})


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    models = await _gateway(request).registry.models()
    return JSONResponse({"object": "list", "data": [m.openai() for m in models]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> Response:
    info = await _gateway(request).require_model(model)
    return JSONResponse(info.openai())


@router.get("/openapi.json")
async def openapi(request: Request) -> Response:
    return Response(_gateway(request).spec.json_bytes, media_type="application/json")
