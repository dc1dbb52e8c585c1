"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): the model's log-probability of
every prompt token after the first, with the top-k alternatives, computed chunk by chunk.

Rules:
- Row j of a prompt chunk that starts at position s holds the logits of position s + j, which
  predict prompt token s + j + 1. The scheduler says how many leading rows of each chunk do
  (`ScheduledRequest.prompt_logprob_rows`); the chunk that reaches the prompt's last position
  samples from it as usual.
- `compute` turns those rows' hidden states into logits ROWS_AT_ONCE rows at a time (a prompt
  chunk's full [T, vocab] logits would take GBs), through the model's own `compute_logits` (so a
  tensor-parallel LM head's all-gather runs on every rank: workers call it with gather=False),
  and keeps only each row's log-softmax at the next prompt token and its top k, on the device.
  Values come from the model's unmodified distribution, like sampled-token logprobs.
- One request's gathering failing fails that request (`failed`), never the step: the logits of
  every slice are still computed, so the ranks' collectives stay in step.
- `store` writes a part's host values into `Request.prompt_logprobs` by position: a chunk
  recomputed after preemption overwrites the same entries with the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flotilla.services.engine.request import Request, TokenLogprobs
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.scheduler import ScheduledRequest

ROWS_AT_ONCE = 256


@dataclass
class PromptLogprobsPart:
    """One chunk's prompt logprobs of one request: rows predicting prompt tokens start+1..."""

    request_id: str
    start: int  # position of the first row
    logprobs: torch.Tensor  # float32 [n], of each next prompt token
    top_ids: torch.Tensor | None  # int64 [n, k]
    top_logprobs: torch.Tensor | None  # float32 [n, k]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PromptLogprobsPart:
        """The same part with `fn` applied to each tensor (e.g. a copy to the host)."""
        return PromptLogprobsPart(
            self.request_id, self.start, fn(self.logprobs),
            None if self.top_ids is None else fn(self.top_ids),
            None if self.top_logprobs is None else fn(self.top_logprobs))


def compute(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
            query_start_loc: Sequence[int], requests: Sequence[ScheduledRequest], gather: bool,
            failed: dict[str, RequestError]) -> list[PromptLogprobsPart]:
    """The prompt logprobs of the step's prompt rows (see module rules); [] when gather=False."""
    parts = []
    for i, r in enumerate(requests):
        n = r.prompt_logprob_rows
        if not n:
            continue
        first = query_start_loc[i]
        k = r.sampling_params.prompt_logprobs or 0
        pieces: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        for a in range(0, n, ROWS_AT_ONCE):
            b = min(a + ROWS_AT_ONCE, n)
            logits = compute_logits(hidden[first + a : first + b])  # every rank
            if not gather or r.request_id in failed:
                continue
            try:
                pieces.append(_gather(logits, r, a, b, k))
            except Exception as exc:  # noqa: BLE001 - one request's failure ends that request
                failed[r.request_id] = RequestError.of(exc, "computing prompt logprobs")
        if pieces and r.request_id not in failed:
            parts.append(PromptLogprobsPart(
                r.request_id, r.num_computed_tokens, torch.cat([p[0] for p in pieces]),
                torch.cat([p[1] for p in pieces]) if k else None,  # type: ignore[misc]
                torch.cat([p[2] for p in pieces]) if k else None))  # type: ignore[misc]
    return parts


def _gather(logits: torch.Tensor, r: ScheduledRequest, a: int, b: int, k: int
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    logprobs = logits.float().log_softmax(dim=-1)
    start = r.num_computed_tokens
    targets = torch.tensor(r.all_token_ids[start + a + 1 : start + b + 1], dtype=torch.int64,
                           device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    if not k:
        return chosen, None, None
    top_lps, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return chosen, top_ids, top_lps


def store(request: Request, part: PromptLogprobsPart) -> None:
    """Write a host part into request.prompt_logprobs (entry p + 1 for the row at position p)."""
    entries = request.prompt_logprobs
    if entries is None:
        return
    prompt = request.token_ids
    lps = part.logprobs.tolist()
    ids = part.top_ids.tolist() if part.top_ids is not None else None
    tops = part.top_logprobs.tolist() if part.top_logprobs is not None else None
    for j, lp in enumerate(lps):
        pos = part.start + j + 1
        top = list(zip(ids[j], tops[j], strict=True)) if ids is not None and tops else []
        entries[pos] = TokenLogprobs(prompt[pos], lp, top)
