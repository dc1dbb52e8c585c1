"""Chat completions with injected MCP tools: the server runs the calls, the client gets the answer.

A request without `tools` is offered the MCP tools of servers that inject them (mcp.json);
`tools: []` opts out. Such a client never sent tools, so it never receives `tool_calls`:

Rules:
- Turn after turn (as /v1/responses' loop): the model's calls run through the tools service
  (only the injected tools' servers are allowed), each call and its result (or error) is
  appended to the conversation, and the model goes again; at most `mcp_max_iterations` turns
  may call tools, the next runs with `tool_choice: none`. A `required` or named tool_choice
  applies to the first turn only (then `auto`), or the model could never answer.
- The answer is the last turn's message; `usage` sums every turn; the executed calls are listed
  in the extension field `mcp_calls` (`name`, `arguments`, `output` or `error`) of the message
  and, streamed, of the last chunk's delta. Streamed, every turn's content and reasoning go out
  as they come (one assistant message); call deltas are never sent.
- One choice only: a request with `n` > 1 is not offered the injected tools (routes.py).
- A turn whose calls cannot run ends the loop: cut off by `max_tokens` (finish `length`) the
  calls are incomplete and none runs; a call whose arguments are not a JSON object is recorded
  with its error and the loop stops there (its arguments could not go back into history).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common.errors import FlotillaError, envelope, internal
from flotilla.libs.common.messages import TextDelta
from flotilla.services.gateway.chunks import ChatChunks
from flotilla.services.gateway.mcp import McpToolset, call_arguments, injected_toolset, run_call
from flotilla.services.gateway.plan import chat_plan, new_request_id
from flotilla.services.gateway.results import ChoiceResult, chat_completion
from flotilla.services.gateway.routes import CLIENT_CLOSED, ClientGone, unless_disconnected
from flotilla.services.gateway.sse import DONE, EventStream, sse
from flotilla.services.gateway.streams import ChoiceStreams
from flotilla.services.gateway.turns import Turn, UsageTotal, new_turn

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState


class McpChat:
    """One chat request's loop over turns and MCP calls."""

    def __init__(self, gw: GatewayState, body: dict[str, Any], toolset: McpToolset):
        self.gw, self.body, self.toolset = gw, body, toolset
        self.rid = new_request_id()
        self.messages = list(body["messages"])
        self.calls: list[dict[str, Any]] = []
        self.usage = UsageTotal()
        self.turn: Turn | None = None
        self.result = ChoiceResult()

    def _turn(self, number: int) -> Turn:
        body = {**self.body, "messages": self.messages}
        if number == self.gw.settings.mcp_max_iterations:
            body["tool_choice"] = "none"
        elif number > 0 and body.get("tool_choice") not in (None, "auto", "none"):
            body["tool_choice"] = "auto"
        # the first turn's request id is `<rid>-0`, as a plain chat request's would be
        rid = self.rid if number == 0 else f"{self.rid}-t{number}"
        return new_turn(self.gw, body, self.toolset.tools, rid)

    async def start(self) -> None:
        """Admit the first turn (a refusal is an HTTP error: nothing was sent yet)."""
        self.turn = self._turn(0)
        await self.turn.start()

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Content and reasoning deltas of every turn; `result` ends as the last turn's."""
        for number in range(self.gw.settings.mcp_max_iterations + 1):
            turn = self.turn if number == 0 and self.turn else self._turn(number)
            if number > 0:
                self.turn = turn
                await turn.start()
            try:
                async for delta in turn.deltas():
                    if delta.text or delta.reasoning:
                        yield TextDelta(text=delta.text, reasoning=delta.reasoning)
            finally:
                turn.close()
            self.result = turn.result
            if turn.result.final is None:
                return  # cancelled
            self.usage.add(turn.result.final.usage)
            if not turn.result.tool_calls or turn.result.final.finish_reason == "length":
                return
            if not await self._run_calls(turn.result):
                return

    async def _run_calls(self, result: ChoiceResult) -> bool:
        """Run the turn's calls; False (the loop ends) when a call's arguments are unusable."""
        bad = [c for _, c in sorted(result.tool_calls.items())
               if call_arguments(c["arguments"]) is None]
        if bad:
            self.calls.extend({"name": c["name"], "arguments": c["arguments"],
                               "error": "the arguments are not a JSON object"} for c in bad)
            return False
        calls: list[dict[str, Any]] = [
            {"id": c["id"] or f"call_{self.rid}_{len(self.calls) + k}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for k, c in sorted(result.tool_calls.items())]
        message: dict[str, Any] = {"role": "assistant", "content": result.text or None,
                                   "tool_calls": calls}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        self.messages.append(message)
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            outcome = await run_call(self.gw, self.toolset, name, arguments)
            record: dict[str, Any] = {"name": name, "arguments": arguments}
            record.update({"output": outcome.output} if outcome.error is None
                          else {"error": outcome.error})
            self.calls.append(record)
            content = outcome.output if outcome.error is None else f"Error: {outcome.error}"
            self.messages.append({"role": "tool", "tool_call_id": call["id"],
                                  "content": content or ""})
        return True

    def cancel(self) -> None:
        if self.turn is not None:
            self.turn.cancel()

    def close(self) -> None:
        if self.turn is not None:
            self.turn.close()

    def answer(self, created: int) -> dict[str, Any]:
        plan = chat_plan(self.body, self.toolset.tools, 1, rid=self.rid,
                         reasoning_field=self.gw.settings.reasoning_field)
        result = self.result
        assert result.final is not None
        result.tool_calls = {}  # a call the last turn still made is never the client's to run
        if result.final.finish_reason == "tool_calls":
            result.final = result.final.model_copy(update={"finish_reason": "stop"})
        completion = chat_completion(plan, [result], created)
        completion["choices"][0]["message"]["mcp_calls"] = self.calls
        completion["usage"] = _usage(self.usage)
        return completion


def _usage(total: UsageTotal) -> dict[str, Any]:
    return {"prompt_tokens": total.prompt_tokens, "completion_tokens": total.completion_tokens,
            "total_tokens": total.prompt_tokens + total.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": total.cached_tokens}}


async def _sse(chat: McpChat, chunks: ChatChunks, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        for chunk in chunks.opening():
            yield sse(chunk)
        async for delta in chat.deltas():
            out = chunks.delta(0, delta)
            if out is not None:
                yield sse(out)
        final = chat.result.final
        if final is None:
            raise internal("the reply ended without its final frame")
        if final.finish_reason == "tool_calls":
            final = final.model_copy(update={"finish_reason": "stop"})
        last = chunks.final(0, final)
        last["choices"][0]["delta"]["mcp_calls"] = chat.calls
        yield sse(last)
        if include_usage:
            yield sse({**chunks.usage_chunk(), "usage": _usage(chat.usage)})
    except FlotillaError as exc:
        yield sse(envelope(exc.info))
    finally:
        chat.close()
    yield DONE


async def complete_with_mcp(request: Request, body: dict[str, Any]) -> Response:
    """Serve a validated chat request that was offered the injected MCP tools."""
    gw: GatewayState = request.app.state.gateway
    chat = McpChat(gw, body, injected_toolset(await gw.tools.listing()))
    idle = ChoiceStreams(gw.bus, [], 0, 0)  # McpChat cancels its own turns
    created = int(time.time())
    try:
        await unless_disconnected(request, chat.start(), idle)
    except ClientGone:
        chat.cancel()
        return Response(status_code=CLIENT_CLOSED)
    if body.get("stream"):
        plan = chat_plan(body, chat.toolset.tools, 1, rid=chat.rid,
                         reasoning_field=gw.settings.reasoning_field)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return EventStream(_sse(chat, ChatChunks(plan, created), include_usage),
                           on_disconnect=chat.cancel, on_close=chat.close)

    async def run() -> None:
        async for _ in chat.deltas():
            pass

    try:
        await unless_disconnected(request, run(), idle)
    except ClientGone:
        chat.cancel()
        return Response(status_code=CLIENT_CLOSED)
    finally:
        chat.close()
    if chat.result.final is None:
        raise internal("the reply ended without its final frame")
    return JSONResponse(chat.answer(created))

