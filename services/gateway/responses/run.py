"""One response, generated: the agent loop (model → MCP calls → results → model) as a sequence of
stream events, whichever way the client reads them (SSE, one JSON object, a background task).

Rules:
- Each turn renders the conversation from items (`items.chat_messages` over the stored chain,
  this request's input and the output so far), exactly as a later `previous_response_id`
  request will, so every turn and every later request extends the same prompt prefix.
- A turn that calls MCP tools of the request (and no client function) has its calls run one
  after the other through the tools service (each an `mcp_call` item with its output or
  error), then the model goes again. At most `mcp_max_iterations` turns may call tools; the
  turn after the last runs with `tool_choice: none`. A turn that calls a client function ends
  the response (the client runs it and sends the output with `previous_response_id`).
- `max_output_tokens` bounds the tokens of all turns together; a turn cut by it (or by the
  context) ends the response as `incomplete` (reason `max_output_tokens`).
- truncation `auto`: a turn refused for its context length is retried without the oldest item
  of the conversation (and the call outputs that would lose their call), until it fits or
  only the last item is left; `disabled` (default) fails the response.
- A failure (refused turn, dead stream) ends the response as `failed` with an `error` event
  before `response.failed`. `cancel()` stops the turn in flight (its engine work is cancelled)
  and `status` becomes `cancelled`.
- When the run ends, a stored response (`store`, default true) is saved with its history; a
  response of a `conversation` that completed (or is `incomplete`: it has output) has its input
  and output items added to the conversation (not when it failed or was cancelled).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from flotilla.libs.common.errors import FlotillaError
from flotilla.services.gateway.conversations.store import ConversationStore
from flotilla.services.gateway.mcp import McpToolset, run_call
from flotilla.services.gateway.responses.items import chat_messages
from flotilla.services.gateway.responses.output import Event, ResponseOutput
from flotilla.services.gateway.responses.request import ResponseRequest
from flotilla.services.gateway.responses.store import ResponseStore
from flotilla.services.gateway.turns import Turn, UsageTotal, new_turn

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState

_ERROR_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def _droppable(items: list[dict[str, Any]]) -> bool:
    return len(items) > 1


def _drop_oldest(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without its oldest item, nor outputs whose call went with it."""
    rest = items[1:]
    while len(rest) > 1 and rest[0]["type"] in ("function_call_output", "function_call",
                                                "mcp_call", "reasoning"):
        rest = rest[1:]
    return rest


class ResponseRun:
    def __init__(self, gw: GatewayState, req: ResponseRequest, response: dict[str, Any],
                 history: list[dict[str, Any]], input_items: list[dict[str, Any]],
                 mcp: McpToolset, store: ResponseStore,
                 conversations: ConversationStore | None = None):
        self.gw, self.req, self.response, self.mcp, self.store = gw, req, response, mcp, store
        self.conversations = conversations  # with `req.conversation`: where the items go
        self.history, self.input_items = history, input_items
        self.out = ResponseOutput(response, mcp.route)
        self.usage = UsageTotal()
        self._turn: Turn | None = None
        self._first: Turn | None = None  # admitted by prepare(), before any response byte
        self._prompt_items = history + input_items  # what turns see (truncation drops from it)
        self.cancelled = False
        self.incomplete: str | None = None

    @property
    def status(self) -> str:
        return str(self.response["status"])

    def cancel(self) -> None:
        self.cancelled = True
        if self._turn is not None:
            self._turn.cancel()

    def _messages(self) -> list[dict[str, Any]]:
        messages = chat_messages(self._prompt_items + self.out.output)
        instructions = self.req.body.get("instructions")
        return ([{"role": "system", "content": instructions}] if instructions else []) + messages

    async def _start_turn(self, number: int, last: bool) -> Turn:
        tools = (self.req.function_tools + self.mcp.tools) or None
        while True:
            body = {**self.req.chat, "messages": self._messages()}
            if self.req.max_output_tokens is not None:
                body["max_completion_tokens"] = max(
                    1, self.req.max_output_tokens - self.usage.completion_tokens)
            if last and tools:
                body["tool_choice"] = "none"
            elif number > 0 and body.get("tool_choice") not in (None, "auto", "none"):
                body["tool_choice"] = "auto"  # a forced call applies to the first turn only
            rid = self.req.rid if number == 0 else f"{self.req.rid}-t{number}"
            turn = new_turn(self.gw, body, tools, rid, self.req.extra)
            self._turn = turn
            try:
                await turn.start()
                return turn
            except FlotillaError as exc:
                if (exc.info.code != "context_length_exceeded"
                        or self.req.body.get("truncation") != "auto"
                        or not _droppable(self._prompt_items)):
                    raise
                self._prompt_items = _drop_oldest(self._prompt_items)

    async def prepare(self) -> None:
        """Admit the first turn; a refusal raises FlotillaError (an HTTP error: nothing has been
        sent yet)."""
        self._first = await self._start_turn(0, self.gw.settings.mcp_max_iterations == 0)

    async def _turn_events(self, turn: Turn) -> AsyncIterator[Event]:
        try:
            async for delta in turn.deltas():
                for event in self.out.delta(delta):
                    yield event
        finally:
            turn.close()
        if turn.result.final is not None:  # None: cancelled
            self.usage.add(turn.result.final.usage)
        for event in self.out.close_item():
            yield event

    async def _run_mcp(self, calls: list[dict[str, Any]]) -> AsyncIterator[Event]:
        for item in calls:
            yield self.out.mcp_running(item)
            outcome = await run_call(self.gw, self.mcp, self.out.exposed[item["id"]],
                                     item["arguments"])
            for event in self.out.mcp_done(item, outcome.output, outcome.error):
                yield event

    async def _loop(self) -> AsyncIterator[Event]:
        """The turns; sets `incomplete` when one was cut short."""
        last = self.gw.settings.mcp_max_iterations
        for number in range(last + 1):
            if self.cancelled:
                return
            turn = self._first if number == 0 and self._first else await self._start_turn(
                number, number == last)
            async for event in self._turn_events(turn):
                yield event
            final = turn.result.final
            if final is None or self.cancelled:
                return
            calls, self.out.turn_calls = self.out.turn_calls, []
            mcp_calls = [c for c in calls if c["type"] == "mcp_call"]
            async for event in self._run_mcp(mcp_calls):
                yield event
            if final.finish_reason == "length":
                self.incomplete = "max_output_tokens"
                return
            if not mcp_calls or len(mcp_calls) < len(calls):
                return

    async def events(self) -> AsyncIterator[Event]:
        """The response's events, from `response.created` to the terminal one."""
        for event in self.out.opening():
            yield event
        error = None
        try:
            async for event in self._loop():
                yield event
        except FlotillaError as exc:
            code = _ERROR_CODES.get(exc.status, "server_error")
            error = {"code": code, "message": exc.info.message}
            for event in self.out.close_item():
                yield event
            yield self.out.error_event(exc.info.code or code, exc.info.message, exc.info.param)
        except asyncio.CancelledError:  # the client went away: the run stops with it
            self.cancel()
            self.out.finish("cancelled", self.usage)
            self.gw.bus.spawn(self._save())
            raise
        finally:
            if self._turn is not None:
                self._turn.close()
        status = ("cancelled" if self.cancelled else "failed" if error
                  else "incomplete" if self.incomplete else "completed")
        for event in self.out.finish(status, self.usage, self.incomplete, error):
            yield event
        await self._save()

    async def fail(self, exc: Exception) -> None:
        """End a run that never started (its first turn was refused) as failed, and save it."""
        info = exc.info if isinstance(exc, FlotillaError) else None
        message = info.message if info else f"internal error ({type(exc).__name__})"
        code = _ERROR_CODES.get(info.status if info else 500, "server_error")
        self.out.finish("failed", self.usage, error={"code": code, "message": message})
        await self._save()

    async def _save(self) -> None:
        conversation = self.req.conversation
        if (conversation is not None and self.conversations is not None
                and self.status in ("completed", "incomplete")):
            await self.conversations.append(conversation, self.input_items + self.out.output,
                                            "conversation")
        if self.req.store:
            history = self.history + self.input_items + self.out.output
            await self.store.save(self.response, self.input_items, history)

    async def collect(self) -> dict[str, Any]:
        """Run to the end; the final response object."""
        async for _ in self.events():
            pass
        return self.response
