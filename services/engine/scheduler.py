"""Continuous batching: which requests compute how many tokens in the next step.

Rules:
- Each step has a token budget (max_num_batched_tokens). Running decodes are served first, then
  running requests that are part-way through a chunked prefill, then waiting requests by
  priority, first come first served within a level (waiting_queue.py; a waiting request that
  does not fit blocks those behind it).
- A prefill is split into chunks of at most prefill_chunk_size tokens (0: the whole prompt in one
  step), and a chunk also shrinks to the budget left; decodes and prefill chunks share a step.
- At most max_num_seqs requests run at once.
- When the KV pool cannot hold a running request's next tokens, a running request not yet
  scheduled in this step is preempted (the lowest priority, the newest within it): its blocks
  are freed and it goes back to the waiting queue at its place (its priority and arrival), to be
  recomputed (prompt + generated tokens) when it is admitted again. No waiting request is
  admitted in a step that preempted.
- Hybrid models (a StateSlots pool, state_pool.py): a request takes a state slot when admitted
  and gives it back when it finishes or is preempted (its recompute restarts from zero state);
  a waiting request is not admitted while no slot is free.
- A request with prompt_logprobs takes no prefix-cache hit (cached positions have no logits);
  each of its prompt chunks tells the runner how many of its rows give prompt logprobs
  (`prompt_logprob_rows`: rows whose next token is a prompt token) until its first output.
- The scheduler advances num_computed_tokens when it schedules; the Engine appends sampled tokens
  (PLACEHOLDER_TOKEN until a step's results arrive: the next step may be scheduled before, with
  the placeholder as a decode's input) and calls finish_request. Finishing (stop, length or
  abort) frees the request's blocks at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flotilla.services.engine.kv_cache_manager import KVCacheManager, PrefixHit
from flotilla.services.engine.request import Request, RequestStatus
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.state_pool import StateSlots
from flotilla.services.engine.waiting_queue import WaitingQueue


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_chunk_size: int = 8192  # 0 disables chunking

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.prefill_chunk_size < 0:
            raise ValueError(f"invalid scheduler limits: {self}")


# Stands in request.token_ids for a token sampled by a step still running on the device (async
# scheduling): the next step reads it from that step's device output; the Engine writes the real
# id over it when the step's results arrive.
PLACEHOLDER_TOKEN = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions num_computed_tokens.."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (position of token_ids[0])
    block_ids: list[int]  # all the request's blocks, covering the cached and the new tokens
    is_prefill: bool
    samples: bool  # this step reaches the end of the sequence, so a token is sampled
    sampling_params: SamplingParams
    generator: torch.Generator | None
    prompt_len: int
    all_token_ids: list[int]  # prompt + generated so far (read-only; for penalties)
    stop_ids: frozenset[int] = frozenset()  # what min_tokens holds back (eos, stop ids)
    prompt_logprob_rows: int = 0  # leading rows of this chunk that give prompt logprobs
    state_slot: int = -1  # the request's linear-attention state slot (hybrid models)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    has_prompt_logprobs: bool = False  # some request has prompt_logprob_rows in this step
    queue_waits: list[float] = field(default_factory=list)  # seconds each request scheduled
    # for the first time in this step waited since its arrival (flotilla:request_queue_time)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def is_decode_only(self) -> bool:
        return all(len(r.token_ids) == 1 for r in self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 state_slots: StateSlots | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.state_slots = state_slots
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request, new=True)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        # Running requests: decodes first, then unfinished prefill chunks. A request whose
        # last token is still being sampled (async scheduling) waits for it.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:  # one pass, no properties: it runs for every request every step
            left = len(r.token_ids) - r.num_computed_tokens
            if left == 1:
                if len(r.token_ids) - r.num_prompt_tokens < r.max_tokens:
                    decodes.append(r)
            elif left > 1:
                prefills.append(r)
        running = RequestStatus.RUNNING
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not running:  # preempted earlier in this loop
                continue
            # A decode's one token always fits (budget > 0); only prefill chunks are sized.
            num_new = (1 if len(request.token_ids) - request.num_computed_tokens == 1
                       else self._num_new_tokens(request, request.num_computed_tokens, budget))
            if num_new == 0:
                continue
            if not self._allocate_or_preempt(request, num_new, scheduled, out):
                continue
            self._schedule(request, num_new, out, scheduled)
            budget -= num_new
        if out.preempted_ids:
            return out
        # Waiting requests, in order, while they fit.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if self.state_slots is not None and self.state_slots.num_free == 0:
                break
            hit = (PrefixHit([], 0) if request.wants_prompt_logprobs
                   else self.kv.get_computed_blocks(request))
            num_new = self._num_new_tokens(request, hit.num_tokens, budget)
            if num_new == 0:  # the whole remaining prompt must fit and does not
                break
            if not self.kv.allocate_slots(request, num_new, hit.block_ids):
                break
            if self.state_slots is not None:
                self.state_slots.allocate(request)  # a slot is free: checked above
            self.waiting.pop()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
                out.queue_waits.append(request.first_scheduled_time - request.arrival_time)
            request.num_computed_tokens = hit.num_tokens
            self.prefix_hit_tokens += hit.num_tokens
            self.prefix_query_tokens += request.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(request, num_new, out, scheduled)
            budget -= num_new
        return out

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        remaining = request.num_tokens - num_computed
        chunk = self.config.prefill_chunk_size
        if chunk == 0:  # no chunking: all of it or nothing
            return remaining if remaining <= budget else 0
        return min(remaining, chunk, budget)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        """Allocate, preempting the newest unscheduled running request until it fits."""
        while not self.kv.allocate_slots(request, num_new):
            candidates = [r for r in reversed(self.running) if r.request_id not in scheduled]
            victim = max(candidates, key=lambda r: r.priority)  # the first (newest) of the max
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        if self.state_slots is not None:
            self.state_slots.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    def _schedule(
        self, request: Request, num_new: int, out: SchedulerOutput, scheduled: set[str]
    ) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        tokens = request.token_ids
        rows = 0
        if request.wants_prompt_logprobs:
            rows = max(0, min(end, request.num_prompt_tokens - 1) - start)
            out.has_prompt_logprobs |= rows > 0
        out.requests.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=tokens[start:end],
                num_computed_tokens=start,
                block_ids=request.block_ids,
                is_prefill=start < request.num_prompt_tokens or num_new > 1,
                samples=end == len(tokens),
                sampling_params=request.sampling_params,
                generator=request.generator,
                prompt_len=request.num_prompt_tokens,
                all_token_ids=tokens,
                stop_ids=request.stop_ids,
                prompt_logprob_rows=rows,
                state_slot=request.state_slot,
            )
        )
        out.num_batched_tokens += num_new
        request.num_computed_tokens = end
        scheduled.add(request.request_id)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop, length, abort or error) and free its blocks; None if unknown."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        if self.state_slots is not None:
            self.state_slots.free(request)
        request.status = status
        return request
