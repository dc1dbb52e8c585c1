"""One generation request as the engine tracks it between steps.

Rules:
- `token_ids` is the prompt followed by every generated token; `num_computed_tokens` of them have
  K/V in the cache. The last generated token is never in the cache yet: the next step computes it.
- The KV blocks in `block_ids` are owned by the KVCacheManager; the request only records them.
  So is `state_slot` (hybrid models: the StateSlots slot of its linear-attention state, -1 none).
- Preemption (recompute) drops the blocks and resets `num_computed_tokens` to 0; the generated
  tokens are kept and recomputed as part of the next prefill.
- A seeded request owns its `torch.Generator`, so its samples do not depend on its batch companions.
- `priority` (lower first) and `arrival` (a counter the scheduler sets: first come, first served
  within a level) order the waiting queue; `deadline` (Unix time) is when the engine gives up on
  it. `error` says why a request finished with status FINISHED_ERROR.
- With `prompt_logprobs`, `prompt_logprobs` collects one entry per prompt position (entry 0 stays
  None) until the request's first output carries them; `wants_prompt_logprobs` is cleared then.
"""

from __future__ import annotations

import enum
import time
from typing import NamedTuple

import torch

from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # request.error says why; the engine goes on

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED = frozenset((RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR))


class TokenLogprobs(NamedTuple):
    """Log-probabilities for one generated token: the sampled one and the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        generator: torch.Generator | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        # Tokens that end the request (eos unless ignore_eos, plus the stop ids).
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else eos_token_ids
        )
        self.generator = generator
        self.priority = priority
        self.deadline = deadline
        self.arrival = 0  # set by the scheduler when it takes the request
        self.arrival_time = time.time()
        self.first_scheduled_time: float | None = None
        self.min_tokens = sampling_params.min_tokens
        self.wants_prompt_logprobs = sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * len(prompt_token_ids) if self.wants_prompt_logprobs else None)
        self.error: RequestError | None = None
        # Sampling reads the generated tokens on the host (penalties, a grammar): no async
        # overlap for the step after one of its tokens. The params are fixed once added.
        self.samples_from_host_tokens = (sampling_params.has_penalties
                                         or sampling_params.guided is not None)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        self.state_slot = -1  # linear-attention state slot (state_pool.py); -1: none held
        self.num_preemptions = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finished status it causes, if any."""
        self.token_ids.append(token_id)
        if token_id in self.stop_ids and self.num_output_tokens >= self.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
