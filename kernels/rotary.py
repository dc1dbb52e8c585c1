"""Rotary position embedding (RoPE) applied to q and k, full or partial, neox or GPT-J layout.

cos_sin_cache is float32 [max_pos, rot_dim]: columns [0, rot_dim/2) hold cos, the rest sin, for
frequency index i. Only the first rot_dim dims of each head rotate; the rest pass through.
neox (HF llama): pairs are (i, i + rot_dim/2). GPT-J (interleaved): pairs are (2i, 2i + 1).
Inputs are not modified; new tensors are returned.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flotilla.kernels.triton_compat import tl, triton


class RotaryOutput(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    xf = x.float()
    rot, rest = xf[..., :rot_dim], xf[..., rot_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    if rest.shape[-1]:
        rotated = torch.cat((rotated, rest), -1)
    return rotated.to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> RotaryOutput:
    cos_sin = cos_sin_cache.index_select(0, positions).float()[:, None, :]
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, 1, rot_dim / 2] each
    if q.shape[0] != 1 or q.dtype != k.dtype:
        return RotaryOutput(_rotate_ref(q, cos, sin, is_neox), _rotate_ref(k, cos, sin, is_neox))
    # Batch-1 decode: one elementwise pass over q and k together (the same numbers as two
    # passes, fewer ops); with one token the split halves stay contiguous.
    qk = _rotate_ref(torch.cat((q, k), 1), cos, sin, is_neox)
    return RotaryOutput(*qk.split((q.shape[1], k.shape[1]), 1))


@triton.jit
def rotated_halves(
    x_ptr, stride_h, num_heads, rot_half,
    cos, sin,  # [1, BLOCK_R] fp32, this token's cos/sin (zero past rot_half)
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One token's rotated pairs: (o1, o2) [BLOCK_H, BLOCK_R] in x's dtype (rounded as the
    reference rounds; 0 where masked), their columns (i1, i2) and the mask."""
    h = tl.arange(0, BLOCK_H)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < num_heads) & (r < rot_half)
    if IS_NEOX:
        i1 = r
        i2 = r + rot_half
    else:
        i1 = 2 * r
        i2 = 2 * r + 1
    x1 = tl.load(x_ptr + h * stride_h + i1, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + h * stride_h + i2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * cos - x2f * sin).to(x1.dtype)
    o2 = (x2f * cos + x1f * sin).to(x1.dtype)
    return o1, o2, i1, i2, mask


@triton.jit
def rotate_heads(
    x_ptr, out_ptr,  # one token's heads: x [H, D] with head stride stride_h; out likewise
    stride_h, out_stride_h,
    num_heads, head_dim, rot_half,
    cos, sin,  # [1, BLOCK_R] fp32, this token's cos/sin (zero past rot_half)
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= num_heads
    BLOCK_R: tl.constexpr,  # next power of two >= rot_half
    BLOCK_P: tl.constexpr,  # pass-through width, next power of two >= D - 2 * rot_half (or 1)
    HAS_PASS: tl.constexpr,  # rot_dim < D
):
    h = tl.arange(0, BLOCK_H)[:, None]
    o1, o2, i1, i2, mask = rotated_halves(x_ptr, stride_h, num_heads, rot_half, cos, sin,
                                          IS_NEOX, BLOCK_H, BLOCK_R)
    # Rounded to x's dtype first (as the unfused reference does), then to the output's.
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + h * out_stride_h + i1, o1.to(out_ty), mask=mask)
    tl.store(out_ptr + h * out_stride_h + i2, o2.to(out_ty), mask=mask)
    if HAS_PASS:
        p = 2 * rot_half + tl.arange(0, BLOCK_P)[None, :]
        pmask = (h < num_heads) & (p < head_dim)
        rest = tl.load(x_ptr + h * stride_h + p, mask=pmask)
        tl.store(out_ptr + h * out_stride_h + p, rest.to(out_ty), mask=pmask)


@triton.jit
def load_cos_sin(cache_ptr, pos, rot_half, BLOCK_R: tl.constexpr):
    """Position `pos`'s row of the fp32 [max_pos, 2 * rot_half] cos/sin cache: (cos, sin), each
    [1, BLOCK_R], zero past rot_half."""
    r = tl.arange(0, BLOCK_R)[None, :]
    row = cache_ptr + pos * 2 * rot_half
    return (tl.load(row + r, mask=r < rot_half, other=0.0),
            tl.load(row + rot_half + r, mask=r < rot_half, other=0.0))


@triton.jit
def _rotary_kernel(
    pos_ptr,  # int64 [T] positions
    q_ptr, k_ptr,  # [T, Hq, D], [T, Hk, D]; token/head strides free, last dim contiguous
    q_out_ptr, k_out_ptr,  # contiguous outputs of the same shapes
    cache_ptr,  # fp32 [max_pos, 2 * rot_half] contiguous: cos then sin
    stride_qt, stride_qh, stride_kt, stride_kh,
    num_q_heads, num_k_heads, head_dim, rot_half,
    IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_PASS: tl.constexpr,
):
    # One program per token: read its cos/sin once and rotate all q and k heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    cos, sin = load_cos_sin(cache_ptr, pos, rot_half, BLOCK_R)
    rotate_heads(
        q_ptr + t * stride_qt, q_out_ptr + t * num_q_heads * head_dim, stride_qh, head_dim,
        num_q_heads, head_dim, rot_half, cos, sin, IS_NEOX, BLOCK_HQ, BLOCK_R, BLOCK_P, HAS_PASS,
    )
    rotate_heads(
        k_ptr + t * stride_kt, k_out_ptr + t * num_k_heads * head_dim, stride_kh, head_dim,
        num_k_heads, head_dim, rot_half, cos, sin, IS_NEOX, BLOCK_HK, BLOCK_R, BLOCK_P, HAS_PASS,
    )


def check_rotary_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Shape / dtype / layout contract of the rotary launchers."""
    num_tokens, _, head_dim = q.shape
    rot_dim = cos_sin_cache.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    if positions.shape != (num_tokens,) or positions.dtype != torch.int64:
        raise ValueError("positions must be int64 [T]")
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous float32 [max_pos, rot_dim]")
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have a contiguous last dim")


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> RotaryOutput:
    check_rotary_args(positions, q, k, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin_cache.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return RotaryOutput(q_out, k_out)
    rot_half = rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, q_out, k_out, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_q_heads, num_k_heads, head_dim, rot_half,
        IS_NEOX=is_neox,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_R=triton.next_power_of_2(rot_half),
        BLOCK_P=triton.next_power_of_2(max(head_dim - rot_dim, 1)),
        HAS_PASS=rot_dim < head_dim,
        num_warps=4,
    )
    return RotaryOutput(q_out, k_out)
