"""FP8 (e4m3) weights with one float32 scale per output channel: y = (x @ W8.T) * scale.

- Decode (M <= GEMV_MAX_M): a Triton GEMV reads the fp8 bytes once, converts in registers and
  accumulates in fp32; the scale is applied to each row's sum (weight-only, x stays 16-bit).
- Prefill on sm_89+ (Ada, Hopper): x is quantized per token to e4m3 (dynamic scales) and
  `torch._scaled_mm` runs the fp8 tensor cores with row-wise scales.
- Elsewhere: a Triton GEMM that dequantizes tiles to x's dtype for tl.dot; on CPU, the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GEMV_MAX_M = 2


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (e4m3 [N, K], float32 scales [N]) with scale = max|W[n]| / 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize-then-matmul in x's dtype."""
    return F.linear(x, (weight.float() * scale[:, None].float()).to(x.dtype))


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # e4m3 [N, K], unit stride along K
    s_ptr,  # float32 [N] per-channel scales
    out_ptr,  # [M, N] in x's dtype
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    out = tl.sum(acc, axis=1) * scale
    tl.store(out_ptr + m * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # e4m3 [N, K]
    s_ptr,  # float32 [N]
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc,
                     input_precision=DOT_PRECISION)
    scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    out = acc * scale[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dtype != FP8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError("weight must be float8_e4m3fn [N, K] with contiguous rows")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape[1]}")
    if scale.shape != (weight.shape[0],) or scale.dtype != torch.float32:
        raise ValueError("scale must be float32 [N]")


def _scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not x.is_cuda or x.dtype != torch.bfloat16 or not hasattr(torch, "_scaled_mm"):
        return False
    n, k = weight.shape
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and n % 16 == 0 and k % 16 == 0


def _scaled_mm(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-token dynamic e4m3 activations x per-channel e4m3 weights on the fp8 tensor cores."""
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    x8 = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale[None, :],
                            out_dtype=x2.dtype)


def fp8_matmul_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      use_scaled_mm: bool = True) -> torch.Tensor:
    """x [..., K] @ (weight * scale[:, None]).T -> [..., N] in x's dtype."""
    _check(x, weight, scale)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    if m > GEMV_MAX_M and use_scaled_mm and _scaled_mm_ok(x2, weight):
        return _scaled_mm(x2, weight, scale).reshape(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m <= GEMV_MAX_M:
        bn = 8
        _gemv_kernel[(triton.cdiv(n, bn), m)](
            x2, weight, scale, out, n, k, x2.stride(0), weight.stride(0), out.stride(0),
            BLOCK_N=bn, BLOCK_K=512, num_warps=4,
        )
    else:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        grid = (triton.cdiv(m, bm), triton.cdiv(n, 64))
        _gemm_kernel[grid](
            x2, weight, scale, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
            num_stages=3,
        )
    return out.reshape(*x.shape[:-1], n)
