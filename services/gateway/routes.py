"""HTTP handlers: decode → validate against the spec → plan → run on the bus → encode.

Rules:
- Every body is read with a cap, parsed with a depth bound (limits.py) and validated against the
  operation's schema in the spec before anything else; sizes the schema cannot bound come next
  (request_body.py: one preamble for every route).
- Every generation request has a deadline (overload.py): each choice's TextRequest carries it,
  and the gateway's readers end the response when it passes.
- Errors before the first response byte (bad input, unknown model, refused admission, no
  tokenizer) are HTTP errors in the envelope; a stream that fails later ends with an error event.
- A client that goes away (streaming or not, even during admission) gets its choices cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common.deadline import Deadline
from flotilla.libs.common.errors import internal, invalid_request
from flotilla.services.gateway.chunks import chunk_builder
from flotilla.services.gateway.conversations.chat import AfterReply, in_conversation
from flotilla.services.gateway.functions import from_legacy
from flotilla.services.gateway.key_usage import CURRENT as KEY_USAGE
from flotilla.services.gateway.plan import Plan, chat_plan, completion_plan
from flotilla.services.gateway.request_body import gateway, model_request, request_deadline
from flotilla.services.gateway.results import (
    ChoiceResult,
    chat_completion,
    collect,
    text_completion,
)
from flotilla.services.gateway.sse import EventStream, sse_events
from flotilla.services.gateway.streams import ChoiceStreams

router = APIRouter()
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do


class ClientGone(Exception):
    pass


class Cancellable(Protocol):
    """What a client's disconnect cancels: its choices (ChoiceStreams), or one pooling request."""

    def cancel(self, reason: str = "client_disconnect") -> None: ...

    def close(self) -> None: ...


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T], streams: Cancellable) -> T:
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


async def generate(request: Request, plan: Plan, deadline: Deadline,
                   after: AfterReply | None = None) -> Response:
    """Run `plan`; `after(results, rid)`, when given, runs once every choice is complete (a
    chat request in a conversation: conversations/chat.py)."""
    gw = gateway(request)
    done = None if after is None else functools.partial(_after, after, plan.rid)
    for req in plan.requests:
        req.deadline = deadline.at
    streams = ChoiceStreams(gw.bus, plan.requests,
                            admission_timeout_s=gw.settings.request_timeout_s,
                            stream_timeout_s=gw.settings.heartbeat_timeout_s, deadline=deadline,
                            timer=gw.metrics.timer(plan.requests[0].model))
    created = int(time.time())
    try:
        await unless_disconnected(request, streams.start(), streams)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if plan.stream:
        events = sse_events(streams, chunk_builder(plan, created), plan.include_usage, done)
        return EventStream(events, on_disconnect=streams.cancel, on_close=streams.close)
    try:
        results = await unless_disconnected(request, collect(streams), streams)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        streams.close()
    if any(r.final is None for r in results):
        raise internal("a choice ended without its final frame")
    if done is not None:
        await done(results)
    build = chat_completion if plan.kind == "chat" else text_completion
    return JSONResponse(build(plan, results, created))


async def _after(after: AfterReply, rid: str, results: list[ChoiceResult]) -> None:
    await after(results, rid)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    gw = gateway(request)
    deadline = request_deadline(request)
    body, _ = await model_request(request, "createChatCompletion", "generate", deadline,
                                  schema_sizes=True)
    body = from_legacy(body)
    tools = await gw.tools.tools_for(body)
    after = None
    if body.get("conversation") is not None:
        if body.get("tools") is None and tools:
            raise invalid_request("The server's MCP tools are not run in a `conversation`; send "
                                  "`tools: []` or your own tools.", param="conversation")
        body, after = await in_conversation(request.app.state.conversations, body)
    if body.get("tools") is None and tools:  # injected MCP tools: the server runs their calls
        if int(body.get("n") or 1) == 1:
            from flotilla.services.gateway.mcp_chat import (
                complete_with_mcp,  # it imports this module
            )

            return await complete_with_mcp(request, body)
        tools = []  # the server's tool loop serves one choice; n choices answer without it
    return await generate(request, chat_plan(body, tools, gw.settings.max_n,
                                             reasoning_field=gw.settings.reasoning_field),
                          deadline, after)


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    gw = gateway(request)
    deadline = request_deadline(request)
    body, _ = await model_request(request, "createCompletion", "generate", deadline,
                                  schema_sizes=True)
    return await generate(request, completion_plan(body, gw.settings.max_n), deadline)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    models = await gateway(request).registry.models()
    usage = KEY_USAGE.get()
    if usage is not None:
        models = [m for m in models if usage.record.allows(m.id)]
    return JSONResponse({"object": "list", "data": [m.openai() for m in models]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> Response:
    usage = KEY_USAGE.get()
    if usage is not None:
        usage.check_model(model)
    info = await gateway(request).require_model(model)
    return JSONResponse(info.openai())


@router.get("/openapi.json")
async def openapi(request: Request) -> Response:
    return Response(gateway(request).spec.json_bytes, media_type="application/json")
