"""The greedy token of each row: `argmax` with torch.argmax semantics (the lowest index among
equal maxima, 0 for a row of -inf).

The Triton form is two launches, per-chunk bests then one program per row: torch.argmax over a
[B, 128256] row runs one thread block per row (28 us at batch 1 on an H100).
"""

from __future__ import annotations

import torch

from flotilla.kernels.triton_compat import tl, triton


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the index of each row's maximum of logits [B, V] (lowest on ties)."""
    return logits.argmax(dim=-1)


@triton.jit
def _chunk_best_kernel(
    logits_ptr,  # [B, V] float logits (any float dtype), -inf for excluded tokens
    best_val_ptr,  # fp32 [B, C] each chunk's best logit
    best_idx_ptr,  # int32 [B, C] its lowest index (a token id)
    stride_l,  # row stride of logits
    vocab,
    num_chunks,  # C
    BLOCK: tl.constexpr,  # tokens per chunk
):
    # Grid (B, C); _best_rows_kernel then picks each row's best chunk. Lanes past the
    # vocabulary score -inf at higher indices than any real token, so a row of -inf still
    # yields its chunk's first token.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    score = tl.load(logits_ptr + row * stride_l + offs, mask=mask,
                    other=float("-inf")).to(tl.float32)
    best, idx = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_val_ptr + row * num_chunks + chunk, best)
    tl.store(best_idx_ptr + row * num_chunks + chunk, chunk * BLOCK + idx)


@triton.jit
def _best_rows_kernel(
    best_val_ptr,  # fp32 [B, C]
    best_idx_ptr,  # int32 [B, C]
    out_ptr,  # int64 [B]
    num_chunks,  # C
    BLOCK_C: tl.constexpr,  # C padded to a power of two
):
    # Grid (B,): the first chunk holding the row's maximum holds its lowest index.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    vals = tl.load(best_val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    idxs = tl.load(best_idx_ptr + row * num_chunks + offs, mask=mask, other=0)
    _, c = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(offs == c, idxs, 0), 0).to(tl.int64))


def _best_per_row(logits: torch.Tensor, block: int) -> torch.Tensor:
    """int64 [B]: per row, the token with the largest logit, the lowest index on ties."""
    batch, vocab = logits.shape
    chunks = triton.cdiv(vocab, block)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    best_val = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
    _chunk_best_kernel[(batch, chunks)](
        logits, best_val, best_idx, logits.stride(0), vocab, chunks, BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    _best_rows_kernel[(batch,)](best_val, best_idx, out, chunks,
                                BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return out


def argmax_triton(logits: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """argmax_ref's result from two Triton launches (block: tokens per chunk of the first, a
    power of two; default 4096: 32 programs per 128k-token row). Rows holding NaN give an
    unspecified index (torch.argmax: the first NaN's)."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError("logits must be a float [B, V] tensor")
    vocab = logits.shape[1]
    if not 0 < vocab < 2**31:
        raise ValueError(f"vocab {vocab} must be in [1, 2^31) (int32 token ids)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = block or min(4096, triton.next_power_of_2(vocab))
    if block & (block - 1):
        raise ValueError(f"block {block} must be a power of two")
    return _best_per_row(logits, block)
