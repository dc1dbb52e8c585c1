"""GPU-friendly sampling helpers: penalties, temperature, top-k / top-p / min-p, seeded draws.

Nothing here synchronises with the host: per-row parameters are tensors, and randomness comes from
a counter-based hash of (seed, step, token id), so a request's draw depends only on its own seed
and step (not on batch composition or device), and the torch reference and the Triton kernel pick
the same token. Sampling is the exponential race (Gumbel-max): argmax(logit - log(-log u)).

Rules: `steps` must differ between a request's successive draws (use its output length);
requests without a user seed get a random one when admitted.

Greedy rows take `argmax` (torch.argmax semantics: the lowest index among equal maxima, 0 for a
row of -inf). Its Triton form is two launches, per-chunk bests then one program per row:
torch.argmax over a [B, 128256] row runs one thread block per row (28 us at batch 1 on an H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys_ref(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit key from an int64 seed and step (int64 tensor holding a uint32)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    return _hash32_ref(lo ^ _hash32_ref(hi ^ _hash32_ref((steps & _M32) ^ _GOLDEN)))


def uniform_noise_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from each row key and the token id."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _hash32_ref(keys[:, None] ^ ((ids * _GOLDEN) & _M32)[None, :])
    return ((bits >> 8).float() + 0.5) / 16777216.0


def sample_ref(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Token ids [B] drawn from softmax(logits) (rows may hold -inf), seeded per row."""
    u = uniform_noise_ref(row_keys_ref(seeds, steps), logits.shape[1])
    return (logits.float() - torch.log(-torch.log(u))).argmax(dim=1)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """New logits [B, V]. Repetition (HF: divide positive / multiply negative logits of tokens
    seen in prompt or output, 1 = off) and OpenAI presence / frequency penalties (output tokens
    only, 0 = off). prompt_mask bool [B, V]; output_counts int [B, V]; penalties float [B]."""
    logits = logits.float()
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.float()[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    counts = output_counts.float()
    return logits - frequency.float()[:, None] * counts - presence.float()[:, None] * (counts > 0)


def token_counts(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [B, V] occurrence counts of token_ids [B, L] (padding: any id < 0)."""
    ids = torch.where(token_ids < 0, vocab, token_ids).long()
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / temperature per row; temperature <= 0 (greedy rows) leaves the row unchanged."""
    t = temperature.float()[:, None]
    return logits.float() / torch.where(t > 0, t, 1.0)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every token outside top-k (k <= 0: off), outside the smallest nucleus of mass
    >= top_p (1: off) or with probability < min_p * max probability (0: off). Keeps >= 1 token."""
    logits = logits.float()
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    drop |= mass_before >= top_p.float()[:, None]
    drop |= probs < min_p.float()[:, None] * probs[:, :1]
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


@triton.jit
def _hash32(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _chunk_best_kernel(
    logits_ptr,  # [B, V] float logits (any float dtype), -inf for excluded tokens
    keys_ptr,  # int64 [B] row keys (uint32 values) from row_keys_ref (read with RACE only)
    best_val_ptr,  # fp32 [B, C] each chunk's best score
    best_idx_ptr,  # int32 [B, C] its lowest index (a token id)
    stride_l,  # row stride of logits
    vocab,
    num_chunks,  # C
    RACE: tl.constexpr,  # score = logit + Gumbel noise of (row key, token): a sample; else argmax
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
    if RACE:
        key = tl.load(keys_ptr + row).to(tl.uint32)
        bits = _hash32(key ^ (offs.to(tl.uint32) * 0x9E3779B9))
        u = ((bits >> 8).to(tl.float32) + 0.5) / 16777216.0
        score = tl.where(mask, score - tl.log(-tl.log(u)), float("-inf"))
    best, idx = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_val_ptr + row * num_chunks + chunk, best)
    tl.store(best_idx_ptr + row * num_chunks + chunk, chunk * BLOCK + idx)


def _best_per_row(logits: torch.Tensor, keys: torch.Tensor | None, block: int) -> torch.Tensor:
    """int64 [B]: per row, the token with the best score (RACE when keys are given), the
    lowest index on ties; two launches."""
    batch, vocab = logits.shape
    chunks = triton.cdiv(vocab, block)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    best_val = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
    _chunk_best_kernel[(batch, chunks)](
        logits, keys if keys is not None else best_idx, best_val, best_idx, logits.stride(0),
        vocab, chunks, RACE=keys is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )
    _best_rows_kernel[(batch,)](best_val, best_idx, out, chunks,
                                BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return out


def sample_triton(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("logits must be [B, V] with a contiguous last dim")
    batch, vocab = logits.shape
    if seeds.shape != (batch,) or steps.shape != (batch,):
        raise ValueError("seeds and steps must be [B]")
    keys = row_keys_ref(seeds.long(), steps.long())
    return _best_per_row(logits, keys, min(4096, triton.next_power_of_2(vocab)))


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the index of each row's maximum of logits [B, V] (lowest on ties)."""
    return logits.argmax(dim=-1)


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
    return _best_per_row(logits, None, block)
