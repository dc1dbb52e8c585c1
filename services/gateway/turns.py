"""One model turn of a chat-shaped request, for the APIs that are thin translations of chat
completions (Anthropic's Messages, OpenAI's Responses) and for loops of several turns (MCP).

Rules:
- A turn is exactly what `/v1/chat/completions` would run for the same chat-shaped body:
  `chat_plan` builds its one TextRequest, `ChoiceStreams` admits and reads it. `extra` sets
  TextRequest fields chat bodies do not spell (reasoning_effort, continue_final_message, ...).
- `Turn.deltas()` yields the turn's text deltas and accumulates them into `result`
  (`results.ChoiceResult`); after it ends `result.final` is set, or it raised FlotillaError.
- Whoever starts a turn ends it: `cancel()` (the client left, the loop was stopped) publishes
  the engine cancel for an unfinished turn; `close()` releases the reader. Both are idempotent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flotilla.libs.common.messages import TextDelta, TextRequest, Usage
from flotilla.services.gateway.plan import chat_plan
from flotilla.services.gateway.results import ChoiceResult
from flotilla.services.gateway.streams import ChoiceStreams

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState


@dataclass
class Turn:
    streams: ChoiceStreams
    result: ChoiceResult = field(default_factory=ChoiceResult)

    @property
    def request_id(self) -> str:
        return self.streams.requests[0].request_id

    async def start(self) -> None:
        """Admit the turn; a refusal is raised as FlotillaError (nothing left to cancel)."""
        await self.streams.start()

    async def deltas(self) -> AsyncIterator[TextDelta]:
        async for _, frame in self.streams.events():
            if frame.kind == "data" and frame.data is not None:
                self.result.add(frame.data)
                yield frame.data
            elif frame.kind == "final":
                self.result.final = frame.final

    async def run(self) -> ChoiceResult:
        """Read the whole turn (non-streaming callers)."""
        async for _ in self.deltas():
            pass
        return self.result

    def cancel(self) -> None:
        self.streams.cancel("client_disconnect")

    def close(self) -> None:
        self.streams.close()


def turn_request(gw: GatewayState, body: dict[str, Any], tools: list[dict[str, Any]] | None,
                 rid: str, extra: dict[str, Any] | None = None) -> TextRequest:
    """The one TextRequest of the chat-shaped `body` (chat_plan's checks raise FlotillaError)."""
    plan = chat_plan(body, tools, 1, rid=rid, reasoning_field=gw.settings.reasoning_field)
    request = plan.requests[0]
    return request.model_copy(update=extra) if extra else request


def new_turn(gw: GatewayState, body: dict[str, Any], tools: list[dict[str, Any]] | None,
             rid: str, extra: dict[str, Any] | None = None) -> Turn:
    """A turn of the chat-shaped `body`, not admitted yet (`await turn.start()`)."""
    request = turn_request(gw, body, tools, rid, extra)
    streams = ChoiceStreams(gw.bus, [request],
                            admission_timeout_s=gw.settings.request_timeout_s,
                            stream_timeout_s=gw.settings.heartbeat_timeout_s,
                            timer=gw.metrics.timer(request.model))
    return Turn(streams)


@dataclass
class UsageTotal:
    """Token counts summed over the turns of one answer (each turn is a full prompt)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens
