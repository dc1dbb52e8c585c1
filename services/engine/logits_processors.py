"""Per-request changes to the logits before sampling: logit_bias, penalties, min_tokens, and a
grammar's token bitmask.

Rules:
- Order: logit_bias -> penalties -> min_tokens (the request's stop tokens to -inf while it has
  fewer than min_tokens outputs) -> grammar bitmask (structured.py: disallowed tokens to -inf).
- Built on the host once per step, only from the rows whose params process logits
  (`SamplingParams.processes_logits`): a batch without them costs one pass over its params.
  Each such row's host work (its bias entries, token histories, grammar matcher) runs on its
  own: what one row raises is recorded in `failed` (row -> RequestError) and that row is left
  unprocessed; the other rows are built as usual. `apply` then runs batched tensor ops only.
- `apply` never modifies the logits it is given (the sampler keeps them for log-probabilities).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.structured import xgrammar

Tensor = Callable[[list[Any], torch.dtype], torch.Tensor]


@dataclass
class Penalties:
    rows: torch.Tensor  # int64 [P]
    prompt_ids: torch.Tensor  # int64 [P, Lp], padded with the vocab size
    output_ids: torch.Tensor  # int64 [P, Lo], padded with the vocab size
    presence: torch.Tensor  # float32 [P, 1]
    frequency: torch.Tensor  # float32 [P, 1]
    repetition: torch.Tensor  # float32 [P, 1]


@dataclass
class _Sparse:
    """(row, token) pairs of the batch, flattened, with a value each (bias) or none (bans)."""

    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class LogitsProcessors:
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, tokens, values
    penalties: Penalties | None
    bans: tuple[torch.Tensor, torch.Tensor] | None  # rows, tokens (min_tokens' stop tokens)
    bitmask: torch.Tensor | None  # int32 [B, ceil(V/32)] (xgrammar), on the host
    guided_rows: list[int]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], token_ids: Sequence[list[int]],
              prompt_lens: Sequence[int], stop_ids: Sequence[frozenset[int]] | None,
              vocab_size: int, tensor: Tensor, failed: dict[int, RequestError]
              ) -> LogitsProcessors | None:
        """The processors of the rows that need them (None if no row does); see module rules."""
        rows = [i for i, p in enumerate(params) if p.processes_logits]
        if not rows:
            return None
        bias, bans = _Sparse(), _Sparse()
        pen_rows: list[int] = []
        bitmask: torch.Tensor | None = None
        guided_rows: list[int] = []
        for i in rows:
            p, tokens, prompt_len = params[i], token_ids[i], prompt_lens[i]
            try:
                if p.logit_bias:
                    bias.rows += [i] * len(p.logit_bias)
                    bias.tokens += p.logit_bias.keys()
                    bias.values += p.logit_bias.values()
                if p.min_tokens and len(tokens) - prompt_len < p.min_tokens:
                    stops = stop_ids[i] if stop_ids is not None else p.stop_token_ids
                    bans.rows += [i] * len(stops)
                    bans.tokens += stops
                if p.guided is not None:
                    if bitmask is None:
                        bitmask = xgrammar().allocate_token_bitmask(len(params), vocab_size)
                    p.guided.fill(bitmask, i, tokens[prompt_len:])
                    guided_rows.append(i)
                if p.has_penalties:
                    pen_rows.append(i)
            except Exception as exc:  # noqa: BLE001 - one request's failure ends that request
                failed[i] = RequestError.of(exc, "processing the logits")
                for sparse in (bias, bans):  # drop what the row added before it failed
                    while sparse.rows and sparse.rows[-1] == i:
                        sparse.rows.pop()
                        sparse.tokens.pop()
                        if sparse.values:
                            sparse.values.pop()
        return cls(
            bias=(tensor(bias.rows, torch.int64), tensor(bias.tokens, torch.int64),
                  tensor(bias.values, torch.float32)) if bias.rows else None,
            penalties=_penalties(params, pen_rows, token_ids, prompt_lens, vocab_size, tensor),
            bans=(tensor(bans.rows, torch.int64), tensor(bans.tokens, torch.int64))
            if bans.rows else None,
            bitmask=bitmask, guided_rows=guided_rows,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A processed copy of logits [B, V] (see module rules for the order)."""
        out = logits.clone()
        if self.bias is not None:
            rows, tokens, values = self.bias
            out.index_put_((rows, tokens), values, accumulate=True)
        if self.penalties is not None:
            apply_penalties(out, self.penalties)
        if self.bans is not None:
            out.index_put_(self.bans, torch.tensor(float("-inf"), device=out.device))
        if self.bitmask is not None and self.guided_rows:
            xgrammar().apply_token_bitmask_inplace(
                out, self.bitmask.to(out.device, non_blocking=True), indices=self.guided_rows)
        return out


def _penalties(params: Sequence[SamplingParams], rows: list[int],
               token_ids: Sequence[list[int]], prompt_lens: Sequence[int], vocab_size: int,
               tensor: Tensor) -> Penalties | None:
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


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """OpenAI presence/frequency over generated tokens; CTRL repetition over prompt + generated.
    In place on `logits`, which it returns."""
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
