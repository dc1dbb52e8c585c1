"""Pooling requests (embeddings, score, rerank): prefill only, one vector out, nothing kept.

Rules:
- A `PoolingJob` is one input: its token ids run through the model like a prompt (paged KV
  blocks held only while the job runs, freed when it finishes, fails or is aborted), no token
  is sampled, and its final-normed hidden states are pooled: `last` (the last token's row),
  `mean` (the average of every row) or `cls` (the first row); then cut to `dimensions`
  (Matryoshka) and L2-normalized when asked (in float32).
- `PoolingQueue` holds the jobs first come, first served (lower `priority` first). Each engine
  step runs one pooling batch beside its generation step (Engine.step): jobs in order while the
  step's token budget lasts, a prompt longer than what is left continuing in later batches
  (chunked, with its partial sums kept). Generation thus never waits more than one budget's
  forward for pooling, and pooling gets a batch every step however busy generation is.
- A job whose blocks do not fit waits (the KV cache is shared with generation); its deadline,
  checked every step, bounds the wait. When the first job in order cannot get its blocks and
  later jobs hold some (long inputs part-way through), those are set back to their start and
  their blocks freed, so the queue always drains (the context length fits the cache).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flotilla.services.engine.kv_cache_manager import KVCacheManager
from flotilla.services.engine.request import Request
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import ScheduledRequest


@dataclass(frozen=True)
class PoolingParams:
    """What the engine does with one input's hidden states (methods: last | mean | cls);
    with `logit_ids`, the LM head's logits of those ids at the last token instead (method
    last, nothing cut or normalized)."""

    method: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    logit_ids: tuple[int, ...] | None = None


def pool_rows(
    rows: torch.Tensor, params: PoolingParams, first: bool, last: bool, partial: torch.Tensor | None
) -> torch.Tensor | None:
    """Fold one chunk's hidden rows [n, H] into the running value of a job (the first row for
    cls, the row sum for mean, the last row for last); None while nothing is known yet."""
    if params.method == "cls":
        return rows[0].float() if first else partial
    if params.method == "mean":
        total = rows.float().sum(dim=0)
        return total if partial is None else partial + total
    return rows[-1].float() if last else None


def finish_vector(
    value: torch.Tensor,
    num_tokens: int,
    params: PoolingParams,
    head: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The job's vector from its running value: averaged (mean), cut, normalized, or the
    `head`'s (the LM head's) logits of `logit_ids`; float32 on the host."""
    if params.logit_ids is not None:
        logits = head(value[None])[0]
        return logits[list(params.logit_ids)].float().cpu()
    if params.method == "mean":
        value = value / num_tokens
    if params.dimensions is not None:
        value = value[: params.dimensions]
    if params.normalize:
        value = torch.nn.functional.normalize(value, p=2.0, dim=0)
    return value.cpu()


class PoolingJob:
    """One input being pooled; `request` only carries its tokens and KV blocks."""

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        params: PoolingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        self.request = Request(
            request_id, token_ids, SamplingParams(), 1, priority=priority, deadline=deadline
        )
        self.params = params
        self.value: torch.Tensor | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def done(self) -> bool:
        return self.request.num_computed_tokens >= self.num_tokens


@dataclass
class PoolingChunk:
    """A job's share of a pooling batch: its tokens start..start+n."""

    job: PoolingJob
    start: int
    num_tokens: int

    def scheduled(self) -> ScheduledRequest:
        r = self.job.request
        return ScheduledRequest(
            request_id=r.request_id,
            token_ids=r.token_ids[self.start : self.start + self.num_tokens],
            num_computed_tokens=self.start,
            block_ids=r.block_ids,
            is_prefill=True,
            samples=False,
            sampling_params=r.sampling_params,
            generator=None,
            prompt_len=r.num_prompt_tokens,
            all_token_ids=r.token_ids,
        )


@dataclass
class PoolingQueue:
    """The waiting and running pooling jobs (see the module rules)."""

    jobs: dict[str, PoolingJob] = field(default_factory=dict)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def num_tokens(self) -> int:
        return sum(j.num_tokens - j.request.num_computed_tokens for j in self.jobs.values())

    def add(self, job: PoolingJob, max_model_len: int, vocab_size: int) -> None:
        """Queue a job; ValueError for an input the engine cannot take (empty, longer than the
        context, ids outside the vocabulary) or an id already queued."""
        ids, n = job.request.token_ids, job.num_tokens
        if n > max_model_len:
            raise ValueError(f"the input has {n} tokens; the context holds {max_model_len}")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"input token ids must be in [0, {vocab_size})")
        if job.request_id in self.jobs:
            raise ValueError(f"request id {job.request_id} is already running")
        job.request.arrival = next(self._order)
        self.jobs[job.request_id] = job

    def run_batch(
        self,
        kv: KVCacheManager,
        forward: Callable[[list[ScheduledRequest]], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
        budget: int,
        max_seqs: int,
    ) -> list[tuple[PoolingJob, torch.Tensor]]:
        """Schedule and run one batch (`forward`: the hidden states of its chunks' tokens);
        the jobs it finished, taken off the queue with their blocks freed, and their vectors."""
        chunks = self.schedule(kv, budget, max_seqs)
        if not chunks:
            return []
        hidden = forward([c.scheduled() for c in chunks])
        finished, row = [], 0
        for chunk in chunks:
            job = chunk.job
            rows = hidden[row : row + chunk.num_tokens]
            row += chunk.num_tokens
            job.request.num_computed_tokens = chunk.start + chunk.num_tokens
            job.value = pool_rows(rows, job.params, chunk.start == 0, job.done, job.value)
            if job.done and job.value is not None:
                self.remove(job.request_id, kv)
                vector = finish_vector(job.value, job.num_tokens, job.params, head)
                finished.append((job, vector))
        return finished

    def remove(self, request_id: str, kv: KVCacheManager) -> PoolingJob | None:
        job = self.jobs.pop(request_id, None)
        if job is not None:
            kv.free(job.request)
        return job

    def schedule(self, kv: KVCacheManager, budget: int, max_seqs: int) -> list[PoolingChunk]:
        """The next batch: jobs in priority then arrival order, each a chunk of what it has
        left, while the token budget lasts and their blocks fit."""
        chunks: list[PoolingChunk] = []
        order = sorted(self.jobs.values(), key=lambda j: (j.request.priority, j.request.arrival))
        for i, job in enumerate(order):
            if budget <= 0 or len(chunks) >= max_seqs:
                break
            r = job.request
            n = min(job.num_tokens - r.num_computed_tokens, budget)
            if not kv.allocate_slots(r, n):
                if not chunks and self._set_back(order[i + 1 :], kv):
                    return self.schedule(kv, budget, max_seqs)
                break  # first come, first served: no later job jumps a waiting one
            chunks.append(PoolingChunk(job, r.num_computed_tokens, n))
            budget -= n
        return chunks

    @staticmethod
    def _set_back(jobs: list[PoolingJob], kv: KVCacheManager) -> bool:
        """Free the blocks of these jobs, back to their start; False if none held any."""
        holding = [j for j in jobs if j.request.block_ids]
        for job in holding:
            kv.free(job.request)
            job.request.num_computed_tokens = 0
            job.value = None
        return bool(holding)
