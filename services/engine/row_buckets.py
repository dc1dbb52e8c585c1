"""Row counts of eager steps rounded up to a few buckets, and the GEMMs warmed at each of them.

Why: cuBLAS chooses a kernel on the host for every (M, N, K) it has not seen, 2.5-6 ms per weight
shape on an H100 (bench/gemm_first_call.py, git history). A prefill's M is its step's token count,
so every new prompt length and every odd-sized step of a burst paid 10-30 ms before its GPU work
started (bench/shape_probe.py, git history). With buckets the GEMMs see a few dozen row counts, all
met once at start-up.

Rules:
- With padding on (EngineConfig.pad_eager_steps; default: on CUDA), a step that is not
  decode-only runs `token_bucket(T)` rows. Padding rows have token 0, position 0 and slot -1
  (their K/V are never written); no sequence owns them, and the attention kernels zero their
  outputs (kernels/prefill_attention.py `new_output`), so they stay finite and only row-local
  work ever touches them. Decode-only steps keep their own buckets (cuda_graphs.py).
- The sampled rows are padded to `logits_bucket(S)` (the decode graphs' batch buckets) by
  repeating the last real row; the runner cuts the logits back to S rows.
- `warm_up_gemms` runs every distinct linear layer at every token bucket and the LM head at
  every logits bucket, once, at start-up.
"""

from __future__ import annotations

import logging
import time

import torch

from flotilla.services.engine.cuda_graphs import graph_buckets
from flotilla.services.engine.layers.linear import LinearBase
from flotilla.services.engine.models.base import CausalLM

log = logging.getLogger(__name__)

FINE_ROWS = 256  # up to here buckets are FINE_STEP apart, beyond COARSE_STEP
FINE_STEP = 16
COARSE_STEP = 128


def token_bucket(rows: int, limit: int) -> int:
    """The row count an eager step of `rows` tokens runs (never past `limit`, the step budget,
    unless rows itself is)."""
    step = FINE_STEP if rows <= FINE_ROWS else COARSE_STEP
    return max(rows, min(-(-rows // step) * step, limit))


def token_buckets(limit: int) -> list[int]:
    """Every row count token_bucket gives for a step of at most `limit` tokens."""
    return sorted({token_bucket(n, limit) for n in range(1, limit + 1)})


def logits_bucket(rows: int, max_seqs: int) -> int:
    """The sampled-row count a step of `rows` sampled rows runs its LM head at."""
    return next((b for b in graph_buckets(max_seqs) if b >= rows), rows)


@torch.inference_mode()
def warm_up_gemms(model: CausalLM, hidden_size: int, token_rows: list[int],
                  logits_rows: list[int], dtype: torch.dtype, device: torch.device) -> None:
    """Run each distinct linear layer (quant method and weight shapes) at every token bucket
    and the LM head at every logits bucket, so no step meets a new GEMM shape."""
    t0 = time.perf_counter()
    seen: set[tuple] = set()
    layers = []
    for m in model.modules():
        if isinstance(m, LinearBase):
            key = (type(m.quant_method), m.input_size, m.bias is not None,
                   tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters(
                       recurse=False)))
            if key not in seen:
                seen.add(key)
                layers.append(m)
    widths = [m.input_size for m in layers] + [hidden_size]
    flat = torch.zeros(max(token_rows + logits_rows) * max(widths), dtype=dtype, device=device)

    def rows_of(rows: int, width: int) -> torch.Tensor:  # contiguous, as a step's activations
        return flat[: rows * width].view(rows, width)

    for m in layers:
        for rows in token_rows:
            m.quant_method.apply(m, rows_of(rows, m.input_size), m.bias)
    for rows in logits_rows:
        model.compute_logits(rows_of(rows, hidden_size))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("GEMMs warmed at %d token and %d logits row buckets for %d layer shapes in %.1f s",
             len(token_rows), len(logits_rows), len(layers), time.perf_counter() - t0)
