"""Batched token sampling: logits processors, temperature, top-k / top-p / min-p, seeds.

Rules:
- One `SamplingBatch` per step describes the rows of the logits matrix (one per sequence that
  samples). It is built on the host from the sampling params; `Sampler.__call__` then runs only
  tensor ops on the logits' device, with no host synchronisation (on CPU one cheap check may
  widen the top-p candidate set; syncs cost nothing there).
- Order: logits processors (logits_processors.py: logit_bias -> penalties -> min_tokens ->
  grammar bitmask) -> greedy argmax | (temperature -> top-k -> top-p -> min-p -> sample).
- Greedy rows (temperature 0) take the exact argmax of the processed logits (`kernels.argmax`:
  the lowest index on ties, like torch.argmax; on CUDA a two-launch Triton argmax, torch's being
  one thread block per row). It is skipped when one sampling group holds every row (all plain
  or all filtered); a batch mixing plain and filtered rows runs it even without greedy rows.
- Random rows are split into "plain" rows (no top-k / top-p: softmax over the whole vocabulary)
  and "filtered" rows, which work on their candidates sorted by logit (the top max(top_k) when
  every such row sets top_k, else the whole vocabulary, or on CPU the top 256 / 2048 when they
  provably hold each row's nucleus).
- Sampling is by inverse CDF with one uniform draw per row. A seeded row draws from its own
  generator, so its tokens do not depend on its batch companions.
- Log-probabilities come from the raw logits (the model's distribution), before any processing.
- One row's failure is that row's: its per-request host work (processors) and its generator's
  draw run on their own, and what they raise lands in `SamplingBatch.failed` / `SamplerOutput.
  failed` (row -> RequestError) while the other rows are sampled as usual. A failed row still
  gets a token (greedy, unprocessed), which the engine discards.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flotilla import kernels
from flotilla.kernels.selection import DEFAULT_SELECTION, KernelSelection
from flotilla.services.engine.logits_processors import LogitsProcessors
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from flotilla.services.engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)

CPU_CANDIDATES = (256, 2048)  # candidate widths tried on CPU before a full sort


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B], of the sampled tokens
    top_token_ids: torch.Tensor | None = None  # int64 [B, n]
    top_logprobs: torch.Tensor | None = None  # float32 [B, n]
    failed: dict[int, RequestError] = field(default_factory=dict)  # row -> why it failed

    @classmethod
    def stack(cls, rows: list[tuple[SamplerOutput, RequestError | None]]) -> SamplerOutput:
        """One output from one-row outputs (each with its row's failure, if any); top-n
        columns padded to the widest row (a row's own n never reads the padding)."""
        tokens = torch.cat([out.token_ids for out, _ in rows])
        failed = {i: err for i, (_, err) in enumerate(rows) if err is not None}
        if all(out.logprobs is None for out, _ in rows):
            return cls(tokens, failed=failed)
        device = tokens.device
        width = max((out.top_token_ids.shape[1] for out, _ in rows
                     if out.top_token_ids is not None), default=0)
        ids = torch.zeros(len(rows), width, dtype=torch.int64, device=device)
        lps = torch.zeros(len(rows), width, device=device)
        logprobs = torch.zeros(len(rows), device=device)
        for i, (out, _) in enumerate(rows):
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[0]
            if out.top_token_ids is not None and out.top_logprobs is not None:
                n = out.top_token_ids.shape[1]
                ids[i, :n], lps[i, :n] = out.top_token_ids[0], out.top_logprobs[0]
        return cls(tokens, logprobs, ids if width else None, lps if width else None, failed)


@dataclass
class RowGroup:
    """Random rows sampled the same way. rows None = every row of the batch."""

    rows: torch.Tensor | None  # int64 [n]
    temperature: torch.Tensor  # float32 [n, 1]
    top_k: torch.Tensor | None  # int64 [n], vocab size where off (filtered group only)
    top_p: torch.Tensor | None  # float32 [n], 1.0 where off
    min_p: torch.Tensor | None  # float32 [n], 0.0 where off
    generators: dict[int, torch.Generator]  # position in the group -> the request's generator
    width: int  # candidates to sort (filtered group); the vocab size means all
    batch_rows: list[int] = field(default_factory=list)  # position in the group -> batch row

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.rows is None else t[self.rows]


@dataclass
class SamplingBatch:
    plain: RowGroup | None
    filtered: RowGroup | None
    max_logprobs: int | None  # the largest top-n asked for in the batch (None: no logprobs)
    processors: LogitsProcessors | None = None  # bias, penalties, min_tokens, grammar bitmask
    failed: dict[int, RequestError] = field(default_factory=dict)  # row -> why it failed

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        token_ids: Sequence[list[int]],
        prompt_lens: Sequence[int],
        vocab_size: int,
        device: torch.device,
        stop_ids: Sequence[frozenset[int]] | None = None,
    ) -> SamplingBatch:
        """params/generators/token_ids (prompt + generated)/prompt_lens/stop_ids (the tokens
        min_tokens holds back; default: each row's stop_token_ids): one entry per row."""

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        failed: dict[int, RequestError] = {}
        processors = LogitsProcessors.build(params, token_ids, prompt_lens, stop_ids,
                                            vocab_size, tensor, failed)

        def group(rows: list[int], filtered: bool) -> RowGroup | None:
            if not rows:
                return None
            ps = [params[i] for i in rows]
            ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in ps]
            return RowGroup(
                rows=None if len(rows) == len(params) else tensor(rows, torch.int64),
                temperature=tensor([[p.temperature] for p in ps], torch.float32),
                top_k=tensor(ks, torch.int64) if filtered else None,
                top_p=tensor([p.top_p for p in ps], torch.float32)
                if any(p.top_p < 1.0 for p in ps) else None,
                min_p=tensor([p.min_p for p in ps], torch.float32)
                if any(p.min_p > 0.0 for p in ps) else None,
                generators={j: g for j, i in enumerate(rows) if (g := generators[i]) is not None},
                width=min(max(ks), vocab_size),
                batch_rows=rows,
            )

        random = [i for i, p in enumerate(params) if not p.is_greedy and i not in failed]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            plain=group([i for i in random if not params[i].needs_top_k_top_p], False),
            filtered=group([i for i in random if params[i].needs_top_k_top_p], True),
            max_logprobs=min(max(logprobs), vocab_size) if logprobs else None,
            processors=processors,
            failed=failed,
        )


class Sampler:
    """Samples a step's rows; greedy rows take `kernels.argmax` under the engine's kernel
    selection (kernels/selection.py; the default when none is given)."""

    def __init__(self, selection: KernelSelection = DEFAULT_SELECTION) -> None:
        self.selection = selection

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: float32 [B, vocab], one row per sampling sequence (not modified)."""
        raw = logits
        if batch.processors is not None:
            logits = batch.processors.apply(logits)
        groups = [(g, fn) for g, fn in ((batch.plain, _sample_plain),
                                        (batch.filtered, _sample_filtered)) if g is not None]
        # rows None: one group holds every row (then it is the only group) and nothing is greedy
        tokens = (None if groups and groups[0][0].rows is None
                  else kernels.argmax(logits, selection=self.selection))
        for grp, fn in groups:
            u = _uniform(grp, logits.device, batch.failed)
            sampled = fn(grp.take(logits) / grp.temperature, grp, u)
            if tokens is None:
                tokens = sampled
            else:
                tokens[grp.rows] = sampled
        assert tokens is not None
        out = SamplerOutput(token_ids=tokens, failed=batch.failed)
        if batch.max_logprobs is not None:
            logprobs = raw.log_softmax(dim=-1)
            out.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            if batch.max_logprobs > 0:
                out.top_logprobs, out.top_token_ids = logprobs.topk(batch.max_logprobs, dim=-1)
        return out


def batch_of(requests: Sequence[ScheduledRequest], vocab_size: int,
             device: torch.device) -> SamplingBatch:
    """The SamplingBatch of a step's sampling requests."""
    return SamplingBatch.build(
        [r.sampling_params for r in requests], [r.generator for r in requests],
        [r.all_token_ids for r in requests], [r.prompt_len for r in requests], vocab_size,
        device, [r.stop_ids for r in requests])


def sample_isolated(sampler: Sampler, logits: torch.Tensor,
                    requests: Sequence[ScheduledRequest], vocab_size: int) -> SamplerOutput:
    """Sample a step's requests; if the batch raises (its per-row parts isolate what they can
    already), sample row by row, so that only the rows that fail on their own are failed.
    Seeded rows drawn before such a batch failure have advanced their generators."""
    try:
        return sampler(logits, batch_of(requests, vocab_size, logits.device))
    except Exception:  # noqa: BLE001 - find the request that broke it; fail only that one
        log.exception("sampling a batch of %d rows failed: sampling row by row", len(requests))
    rows = []
    for i, r in enumerate(requests):
        try:
            out = sampler(logits[i : i + 1], batch_of([r], vocab_size, logits.device))
            rows.append((out, out.failed.get(0)))
        except Exception as exc:  # noqa: BLE001
            rows.append((SamplerOutput(logits[i : i + 1].argmax(dim=-1)), RequestError.of(exc)))
    return SamplerOutput.stack(rows)


def _uniform(grp: RowGroup, device: torch.device,
             failed: dict[int, RequestError]) -> torch.Tensor:
    """One uniform per row of the group: a seeded row's from its own generator."""
    u = torch.rand(len(grp.batch_rows), 1, device=device)
    for j, gen in grp.generators.items():
        try:
            u[j] = torch.rand(1, generator=gen, device=device)
        except Exception as exc:  # noqa: BLE001 - one request's generator fails that request
            failed[grp.batch_rows[j]] = RequestError.of(exc, "drawing from the seeded generator")
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of (unnormalised) probs, given one uniform per row."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _sample_plain(logits: torch.Tensor, grp: RowGroup, u: torch.Tensor) -> torch.Tensor:
    if grp.min_p is not None:
        logits = apply_min_p(logits, grp.min_p)
    return _inverse_cdf(logits.softmax(dim=-1), u)


def _sample_filtered(logits: torch.Tensor, grp: RowGroup, u: torch.Tensor) -> torch.Tensor:
    masked, order = filter_sorted(logits, grp)
    idx = _inverse_cdf(masked.softmax(dim=-1), u)
    return order.gather(1, idx.unsqueeze(1)).squeeze(1)


def filter_sorted(logits: torch.Tensor, grp: RowGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each row sorted by logit (descending), those outside top-k / top-p / min-p
    set to -inf; returns (masked logits [n, W], their vocab ids [n, W])."""
    assert grp.top_k is not None
    sorted_logits, order, lse_full = _candidates(logits, grp)
    pos = torch.arange(sorted_logits.shape[1], device=logits.device)
    masked = sorted_logits.masked_fill(pos >= grp.top_k.unsqueeze(1), float("-inf"))
    if grp.top_p is not None:
        lse = masked.logsumexp(dim=-1)
        if lse_full is not None:  # rows without top-k normalise over the whole vocabulary
            lse = torch.where(grp.top_k < logits.shape[-1], lse, lse_full)
        probs = (masked - lse.unsqueeze(1)).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        masked = masked.masked_fill(mass_before >= grp.top_p.unsqueeze(1), float("-inf"))
    if grp.min_p is not None:
        ratio = (masked - masked[:, :1]).exp()
        masked = masked.masked_fill(ratio < grp.min_p.unsqueeze(1), float("-inf"))
    return masked, order


def _candidates(
    logits: torch.Tensor, grp: RowGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(sorted logits, vocab ids, full-vocab logsumexp if the candidates are a CPU shortcut).

    A full sort is slow on CPU; there the top CPU_CANDIDATES[i] suffice when every row either
    has a top_k that small or has no top-k and a nucleus inside the candidates (checked here; a
    host sync is free on CPU)."""
    assert grp.top_k is not None
    vocab = logits.shape[-1]
    if grp.width < vocab:
        return *logits.topk(grp.width, dim=-1), None
    if logits.device.type == "cpu" and grp.top_p is not None:
        lse_full = logits.logsumexp(dim=-1)
        for width in CPU_CANDIDATES:
            if width * 4 > vocab:
                break
            cand, order = logits.topk(width, dim=-1)
            mass = (cand.logsumexp(dim=-1) - lse_full).exp()
            nucleus_inside = (grp.top_k == vocab) & (mass >= grp.top_p)
            if bool(((grp.top_k <= width) | nucleus_inside).all()):
                return cand, order, lse_full
    return *logits.sort(dim=-1, descending=True), None


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    ratio = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    return logits.masked_fill(ratio < min_p.unsqueeze(1), float("-inf"))
