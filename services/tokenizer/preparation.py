"""Admission of a request's blocking work, so that one client's heavy requests cannot hurt
anyone else's: cost caps, separate lanes for cheap and heavy work and for grammars, a cache of
checked grammars, deadlines.

Per request, in order:
1. past its `deadline` → 504 `deadline_exceeded` (and again after each step below);
2. cost caps (400 naming the parameter): more than `max_tools` tools, tools over
   `max_tools_chars` characters of JSON, a prompt or messages over `max_prompt_chars`;
3. the prompt (template + tokenization) is built on a lane: the heavy lane for requests with
   more than `heavy_tools` tools or `heavy_chars` characters, else the light lane; a short
   completion prompt without a response format is tokenized right on the event loop
   (`inline_prepare_chars`: tens of us, less than a thread hop);
4. the context-length check, before any grammar work;
5. the constraint (response format, forced tool calls) from the spec cache, else checked on the
   grammar lane within `grammar_timeout_s`; requests that need the same check while it runs
   wait for that one (a burst of one schema is one check, not a full grammar queue).
Lanes are bounded (lanes.py): a full one, a wait past `queue_wait_s`, a template past its
budget or a grammar past its limit are 503s with Retry-After, never a 400 and never a hang.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson

from flotilla.libs.common.errors import FlotillaError, deadline_exceeded, invalid_request
from flotilla.libs.common.messages import GuidedDecoding, TextRequest
from flotilla.libs.common.settings import TokenizerSettings
from flotilla.services.tokenizer.guided import forces_tool_calls
from flotilla.services.tokenizer.lanes import Lane
from flotilla.services.tokenizer.prompt import PreparedPrompt, PromptBuilder
from flotilla.services.tokenizer.spec_cache import Entry, SpecCache, spec_key


@dataclass(frozen=True)
class RequestCost:
    tools: int
    tools_chars: int
    prompt_chars: int


def request_cost(req: TextRequest) -> RequestCost:
    tools = req.tools or []
    tools_chars = len(orjson.dumps(tools)) if tools else 0
    if req.kind == "chat":  # as JSON: content, tool calls and their arguments all count
        prompt_chars = len(orjson.dumps(req.messages or []))
    else:
        prompt_chars = len(req.prompt or "") + len(req.suffix or "")
    return RequestCost(len(tools), tools_chars, prompt_chars)


def check_deadline(req: TextRequest, where: str) -> None:
    if req.deadline is not None and time.time() > req.deadline:
        raise deadline_exceeded(f"the request's deadline passed {where}")


class Preparer:
    """Runs `PromptBuilder` work for every request under the rules above."""

    def __init__(self, builder: PromptBuilder, settings: TokenizerSettings):
        self.builder, self.settings = builder, settings
        s = settings
        self.light = Lane("light", s.workers, s.queue_size, s.queue_wait_s)
        self.heavy = Lane("heavy", s.heavy_workers, s.heavy_queue_size, s.queue_wait_s)
        self.grammar = Lane("grammar", s.grammar_workers, s.grammar_queue_size, s.queue_wait_s)
        self.specs = SpecCache(s.grammar_cache_size, s.grammar_cache_mib << 20)
        self._checking: dict[str, asyncio.Future[Entry]] = {}

    def shutdown(self) -> None:
        for lane in (self.light, self.heavy, self.grammar):
            lane.shutdown()

    def check_caps(self, req: TextRequest, cost: RequestCost) -> None:
        s = self.settings
        if cost.tools > s.max_tools:
            raise invalid_request(f"tools: {cost.tools} tools are more than this server's limit "
                                  f"of {s.max_tools}", param="tools", code="invalid_value")
        if cost.tools_chars > s.max_tools_chars:
            raise invalid_request(f"tools: {cost.tools_chars} characters of tool definitions "
                                  f"are more than this server's limit of {s.max_tools_chars}",
                                  param="tools", code="invalid_value")
        if cost.prompt_chars > s.max_prompt_chars:
            param = "messages" if req.kind == "chat" else "prompt"
            raise invalid_request(f"{param}: {cost.prompt_chars} characters are more than this "
                                  f"server's limit of {s.max_prompt_chars}", param=param,
                                  code="invalid_value")

    def _inline(self, req: TextRequest) -> bool:
        limit = self.settings.inline_prepare_chars
        return (req.kind == "completion" and req.response_format is None and req.suffix is None
                and isinstance(req.prompt, str | list) and 0 < len(req.prompt) <= limit)

    async def prepare(self, req: TextRequest) -> PreparedPrompt:
        """The request's prompt and constraint (see module rules)."""
        check_deadline(req, "before the tokenizer took it")
        if self._inline(req):
            prepared = self.builder.prepare_prompt(req)
        else:
            cost = request_cost(req)
            self.check_caps(req, cost)
            heavy = (cost.tools > self.settings.heavy_tools
                     or cost.tools_chars + cost.prompt_chars > self.settings.heavy_chars)
            lane = self.heavy if heavy else self.light
            prepared = await lane.run(lambda: self.builder.prepare_prompt(req), req.deadline)
        self.builder.check_context(req, len(prepared.token_ids))
        prepared.guided = await self.guided(req, prepared)
        check_deadline(req, "while the tokenizer prepared it")
        return prepared

    async def guided(self, req: TextRequest, prepared: PreparedPrompt) -> GuidedDecoding | None:
        """The constraint, from the cache or the grammar lane."""
        if forces_tool_calls(req):
            key = spec_key("tools", req.tools, req.tool_choice, req.parallel_tool_calls,
                           self.builder.tool_format().name, prepared.reasoning_end)
        elif (req.response_format or {}).get("type", "text") != "text":
            key = spec_key("format", req.response_format, prepared.reasoning_end)
        else:
            return None
        found, entry = self.specs.get(key)
        if not found:
            running = self._checking.get(key)
            if running is None:  # shared by every request waiting for it: no one's deadline
                running = asyncio.ensure_future(self.grammar.run(
                    lambda: self._check(key, req, prepared), None,
                    self.settings.grammar_timeout_s))
                self._checking[key] = running
                running.add_done_callback(lambda done: self._checked(key, done))
            entry = await asyncio.shield(running)
        if isinstance(entry, FlotillaError):
            raise entry
        return entry

    def _checked(self, key: str, done: asyncio.Future[Entry]) -> None:
        self._checking.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved here too: every waiter may have gone

    def _check(self, key: str, req: TextRequest, prepared: PreparedPrompt) -> Entry:
        """On a grammar worker: the spec or its 400, remembered either way."""
        entry: Entry
        try:
            entry = self.builder.guided(req, prepared)
        except FlotillaError as exc:
            if exc.status != 400:
                raise
            entry = exc
        self.specs.put(key, entry)
        return entry
