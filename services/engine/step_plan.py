"""What rank 0 tells the other ranks of a tensor-parallel pod before each forward: the step plan.

Rules:
- A plan carries what the workers' StepInputBuilder and input-id resolution read: per scheduled
  request its token ids (PLACEHOLDER_TOKEN included), num_computed_tokens, is_prefill, whether
  it samples, and its KV block ids; plus the step's decode_only and share_tokens flags; and,
  only in steps that have them, each request's prompt_logprob_rows (the LM head's all-gather
  runs for those rows on every rank); and, for hybrid models, each request's linear-attention
  state slot (rank 0's scheduler hands them out; every rank keeps its shard of the states).
  Sampling parameters, generators and token histories stay on rank 0: only it samples.
- Block ids travel as deltas. The encoder remembers the block list it sent for each request of
  the previous step; a request scheduled again with the same list object sends only the new tail
  (KVCacheManager only appends to a request's list until it frees it, and freeing replaces the
  list). Anything else (a new, preempted or paused request) sends its whole list. The decoder
  keeps the mirror image, so both sides hold exactly the previous step's requests.
- Request ids travel as small ints; workers name their requests str(int).
- Payloads are pickled tuples: every rank runs the same code, and rank 0 is trusted.
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import ScheduledRequest


class StepPlan(NamedTuple):
    decode_only: bool
    share_tokens: bool  # rank 0 broadcasts the sampled tokens after the step
    ids: list[int]
    token_ids: list[list[int]]
    num_computed: list[int]
    is_prefill: list[bool]
    samples: list[bool]
    new_blocks: list[list[int]]
    replace: list[bool]  # new_blocks is the whole list, not a tail
    prompt_rows: list[int] | None = None  # prompt_logprob_rows per request (None: all 0)
    state_slots: list[int] | None = None  # state slot per request (None: not a hybrid model)


class LogitsPlan(NamedTuple):
    """One sequence's prompt logits (Engine.prompt_logits); outside the step state."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    state_slot: int = -1


class StopPlan(NamedTuple):
    pass


Plan = StepPlan | LogitsPlan | StopPlan


class _Sent(NamedTuple):
    key: int  # the request's id on the wire
    blocks: list[int]  # the scheduler's own list object
    num_blocks: int  # how many of its ids the workers have
    last: int  # the last of them (-1: none), a cheap guard against in-place rewrites


class PlanEncoder:
    """Rank 0: SchedulerOutput requests -> plan bytes."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._next_index = 0

    def step(self, requests: list[ScheduledRequest], decode_only: bool,
             share_tokens: bool) -> bytes:
        sent, now = self._sent, {}
        n = len(requests)
        ids: list[int] = [0] * n
        new_blocks: list[list[int]] = [[]] * n  # every entry is replaced below
        replace = [False] * n
        for i, r in enumerate(requests):
            blocks = r.block_ids
            prev = sent.get(r.request_id)
            if (prev is not None and prev.blocks is blocks and len(blocks) >= prev.num_blocks
                    and (prev.num_blocks == 0 or blocks[prev.num_blocks - 1] == prev.last)):
                index = prev.key
                new_blocks[i] = blocks[prev.num_blocks:]
            else:
                index = prev.key if prev is not None else self._new_index()
                new_blocks[i], replace[i] = list(blocks), True
            ids[i] = index
            now[r.request_id] = _Sent(index, blocks, len(blocks), blocks[-1] if blocks else -1)
        self._sent = now
        rows = [r.prompt_logprob_rows for r in requests]
        slots = [r.state_slot for r in requests]
        plan = StepPlan(decode_only, share_tokens, ids, [r.token_ids for r in requests],
                        [r.num_computed_tokens for r in requests],
                        [r.is_prefill for r in requests], [r.samples for r in requests],
                        new_blocks, replace, rows if any(rows) else None,
                        slots if any(slot >= 0 for slot in slots) else None)
        return pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)

    def _new_index(self) -> int:
        self._next_index += 1
        return self._next_index

    @staticmethod
    def logits(request: ScheduledRequest) -> bytes:
        plan = LogitsPlan(request.token_ids, request.num_computed_tokens, request.block_ids,
                          request.state_slot)
        return pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def stop() -> bytes:
        return pickle.dumps(StopPlan(), protocol=pickle.HIGHEST_PROTOCOL)


_PARAMS = SamplingParams()  # workers never sample; the builder ignores sampling fields


def _request(request_id: str, token_ids: list[int], num_computed: int, block_ids: list[int],
             is_prefill: bool, samples: bool, prompt_rows: int = 0, state_slot: int = -1
             ) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id, token_ids=token_ids, num_computed_tokens=num_computed,
        block_ids=block_ids, is_prefill=is_prefill, samples=samples, sampling_params=_PARAMS,
        generator=None, prompt_len=0, all_token_ids=[], prompt_logprob_rows=prompt_rows,
        state_slot=state_slot,
    )


class DecodedStep(NamedTuple):
    requests: list[ScheduledRequest]
    decode_only: bool
    share_tokens: bool


class PlanDecoder:
    """A worker: plan bytes -> a DecodedStep, a one-sequence ScheduledRequest (LogitsPlan) or
    None (StopPlan)."""

    def __init__(self) -> None:
        self._blocks: dict[int, list[int]] = {}

    def decode(self, payload: bytes) -> DecodedStep | ScheduledRequest | None:
        plan: Plan = pickle.loads(payload)
        if isinstance(plan, StopPlan):
            return None
        if isinstance(plan, LogitsPlan):
            return _request("__prompt_logits__", plan.token_ids, plan.num_computed,
                            plan.block_ids, True, False, state_slot=plan.state_slot)
        known, now = self._blocks, {}
        requests = []
        prompt_rows = plan.prompt_rows or [0] * len(plan.ids)
        slots = plan.state_slots or [-1] * len(plan.ids)
        for index, tokens, computed, prefill, samples, blocks, whole, rows, slot in zip(
                plan.ids, plan.token_ids, plan.num_computed, plan.is_prefill, plan.samples,
                plan.new_blocks, plan.replace, prompt_rows, slots, strict=True):
            if whole:
                mine = blocks
            else:
                mine = known[index]
                mine.extend(blocks)
            now[index] = mine
            requests.append(_request(str(index), tokens, computed, mine, prefill, samples, rows,
                                     slot))
        self._blocks = now
        return DecodedStep(requests, plan.decode_only, plan.share_tokens)
