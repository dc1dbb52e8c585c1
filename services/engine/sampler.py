"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds.

Rules:
- One `SamplingBatch` per step describes the rows of the logits matrix (one per sequence that
  samples). It is built on the host from the sampling params; `Sampler.__call__` then runs only
  tensor ops on the logits' device, with no host synchronisation (on CPU one cheap check may
  widen the top-p candidate set; syncs cost nothing there).
- Order: penalties -> structured-output bitmask (structured.py: disallowed tokens of constrained
  rows to -inf) -> greedy argmax | (temperature -> top-k -> top-p -> min-p -> sample).
- Greedy rows (temperature 0) take the exact argmax of the penalised logits (`kernels.argmax`:
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from services.engine.sampling_params import SamplingParams
from services.engine.structured import GuidedBatch

CPU_CANDIDATES = (256, 2048)  # candidate widths tried on CPU before a full sort


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B], of the sampled tokens
    top_token_ids: torch.Tensor | None = None  # int64 [B, n]
    top_logprobs: torch.Tensor | None = None  # float32 [B, n]


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

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.rows is None else t[self.rows]


@dataclass
class Penalties:
    rows: torch.Tensor  # int64 [P]
    prompt_ids: torch.Tensor  # int64 [P, Lp], padded with the vocab size
    output_ids: torch.Tensor  # int64 [P, Lo], padded with the vocab size
    presence: torch.Tensor  # float32 [P, 1]
    frequency: torch.Tensor  # float32 [P, 1]
    repetition: torch.Tensor  # float32 [P, 1]


@dataclass
class SamplingBatch:
    plain: RowGroup | None
    filtered: RowGroup | None
    penalties: Penalties | None
    max_logprobs: int | None  # the largest top-n asked for in the batch (None: no logprobs)
    guided: GuidedBatch | None = None  # bitmask rows of requests under a grammar

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        token_ids: list[list[int]],
        prompt_lens: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        """params/generators/token_ids (prompt + generated)/prompt_lens: one entry per row."""

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        def group(rows: list[int], filtered: bool) -> RowGroup | None:
            if not rows:
                return None
            ps = [params[i] for i in rows]
            ks = [p.top_k if p.top_k > 0 else vocab_size for p in ps]
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
            )

        random = [i for i, p in enumerate(params) if not p.is_greedy]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            plain=group([i for i in random if not params[i].needs_top_k_top_p], False),
            filtered=group([i for i in random if params[i].needs_top_k_top_p], True),
            penalties=_penalties(params, token_ids, prompt_lens, vocab_size, tensor),
            max_logprobs=max(logprobs) if logprobs else None,
            guided=GuidedBatch.build(params, token_ids, prompt_lens, vocab_size),
        )


def _penalties(params, token_ids, prompt_lens, vocab_size, tensor) -> Penalties | None:  # type: ignore[no-untyped-def]
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return None

    def padded(seqs: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(s) for s in seqs))
        return tensor([s + [vocab_size] * (width - len(s)) for s in seqs], torch.int64)

    return Penalties(
        rows=tensor(rows, torch.int64),
        prompt_ids=padded([token_ids[i][: prompt_lens[i]] for i in rows]),
        output_ids=padded([token_ids[i][prompt_lens[i] :] for i in rows]),
        presence=tensor([[params[i].presence_penalty] for i in rows], torch.float32),
        frequency=tensor([[params[i].frequency_penalty] for i in rows], torch.float32),
        repetition=tensor([[params[i].repetition_penalty] for i in rows], torch.float32),
    )


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: float32 [B, vocab], one row per sampling sequence (not modified)."""
        raw = logits
        if batch.penalties is not None:
            logits = apply_penalties(logits.clone(), batch.penalties)
        if batch.guided is not None:
            logits = batch.guided.apply(logits)
        groups = [(g, fn) for g, fn in ((batch.plain, _sample_plain),
                                        (batch.filtered, _sample_filtered)) if g is not None]
        # rows None: one group holds every row (then it is the only group) and nothing is greedy
        tokens = None if groups and groups[0][0].rows is None else kernels.argmax(logits)
        for grp, fn in groups:
            sampled = fn(grp.take(logits) / grp.temperature, grp)
            if tokens is None:
                tokens = sampled
            else:
                tokens[grp.rows] = sampled
        assert tokens is not None
        out = SamplerOutput(token_ids=tokens)
        if batch.max_logprobs is not None:
            logprobs = raw.log_softmax(dim=-1)
            out.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            if batch.max_logprobs > 0:
                out.top_logprobs, out.top_token_ids = logprobs.topk(batch.max_logprobs, dim=-1)
        return out


def _uniform(grp: RowGroup, n: int, device: torch.device) -> torch.Tensor:
    u = torch.rand(n, 1, device=device)
    for j, gen in grp.generators.items():
        u[j] = torch.rand(1, generator=gen, device=device)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of (unnormalised) probs, given one uniform per row."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _sample_plain(logits: torch.Tensor, grp: RowGroup) -> torch.Tensor:
    if grp.min_p is not None:
        logits = apply_min_p(logits, grp.min_p)
    probs = logits.softmax(dim=-1)
    return _inverse_cdf(probs, _uniform(grp, logits.shape[0], logits.device))


def _sample_filtered(logits: torch.Tensor, grp: RowGroup) -> torch.Tensor:
    masked, order = filter_sorted(logits, grp)
    idx = _inverse_cdf(masked.softmax(dim=-1), _uniform(grp, logits.shape[0], logits.device))
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


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """OpenAI presence/frequency over generated tokens; CTRL repetition over prompt + generated."""
    vocab = logits.shape[1]
    sub = logits[pen.rows]
    counts = torch.zeros(sub.shape[0], vocab + 1, device=sub.device, dtype=sub.dtype)
    counts.scatter_add_(1, pen.output_ids, torch.ones_like(pen.output_ids, dtype=sub.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(sub.shape[0], vocab + 1, device=sub.device, dtype=torch.bool)
    seen.scatter_(1, pen.prompt_ids, True)
    seen = seen[:, :vocab] | (counts > 0)
    rep = pen.repetition
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - pen.frequency * counts - pen.presence * (counts > 0).to(sub.dtype)
    logits[pen.rows] = sub
    return logits
