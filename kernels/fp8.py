"""FP8 (e4m3) weights with float32 scales per output channel or per [row, group of K]:
y[m, n] = sum_k x[m, k] * W8[n, k] * scale[n, k // G] (per-channel: scale [N, 1], G = K).

- Decode (kernels/gguf_matmul.py: use_gemv, one or two rows): one x row -> the CUDA-core GEMV
  of kernels/fp8_gemv_fma.py (K and groups multiples of 32; fp32 sums, x keeps its dtype); two
  rows of 16-bit x -> the tensor-core GEMV of kernels/fp8_gemv.py (fp16 products, fp32 sums),
  which reads W once for both (the CUDA-core one reads it per row). H100, Llama-3-8B
  matrices, M = 1: 66-95% of copy bandwidth vs 53-85% on tensor cores; M = 2: 42-71% vs
  52-85%. The selection's fp8_gemv (FLOTILLA_FP8_GEMV=mma|fma, kernels/selection.py) pins one
  where it can run.
- Prefill with per-channel scales on sm_89+ (Ada, Hopper): x is quantized per token to e4m3
  (dynamic scales) and `torch._scaled_mm` runs the fp8 tensor cores with row-wise scales.
- Otherwise a Triton GEMM that dequantizes tiles to x's dtype for tl.dot; on CPU, the reference.
Checkpoints with 2D block scales (DeepSeek style) expand them to one scale row per weight row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul_triton
from flotilla.kernels.fp8_gemv import MAX_M, fp8_gemv_mma, mma_gemv_ok
from flotilla.kernels.fp8_gemv_fma import fma_gemv_ok, fp8_gemv_fma
from flotilla.kernels.gemv_rows import check_gated
from flotilla.kernels.gguf_matmul import _gemm_tiles, use_gemv
from flotilla.kernels.triton_compat import tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (e4m3 [N, K], float32 scales [N, 1]) with scale = max|W[n]| / 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_dequantize_ref(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 [N, K] from e4m3 [N, K] and scales [N, G]."""
    group = weight.shape[1] // scale.shape[1]
    return weight.float() * scale.float().repeat_interleave(group, dim=1)


def fp8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize-then-matmul in x's dtype."""
    return F.linear(x, fp8_dequantize_ref(weight, scale).to(x.dtype))


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # e4m3 [N, K]
    s_ptr,  # float32 [N, K // group]
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    group,
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
        wmask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=wmask,
                    other=0.0)
        s = tl.load(s_ptr + rn[:, None] * stride_sn + (k // group)[None, :], mask=wmask,
                    other=0.0)
        w = (w.to(tl.float32) * s).to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The group size."""
    if weight.dtype != FP8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError("weight must be float8_e4m3fn [N, K] with contiguous rows")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape[0] != n \
            or k % scale.shape[1] or scale.stride(1) != 1:
        raise ValueError(f"scale must be float32 [N, G] with G dividing K={k}, got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    return k // scale.shape[1]


def _scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not x.is_cuda or x.dtype != torch.bfloat16 or not hasattr(torch, "_scaled_mm"):
        return False
    n, k = weight.shape
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and n % 16 == 0 and k % 16 == 0


def _scaled_mm(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-token dynamic e4m3 activations x per-channel e4m3 weights on the fp8 tensor cores."""
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    x8 = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1),
                            out_dtype=x2.dtype)


def fp8_matmul_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      use_scaled_mm: bool = True, kernel: str | None = None,
                      gated: bool = False, fp8_gemv: str = "auto", pdl: str = "auto"
                      ) -> torch.Tensor:
    """x [..., K] @ dequant(weight, scale).T -> [..., N] in x's dtype. gated: the weight is
    [gate; up] and the result silu(gate) * up [..., N / 2], fused into the CUDA-core GEMV when
    it runs. `fp8_gemv` and `pdl`: the selection's choices (module docstring, kernels/pdl.py)."""
    group = _check(x, weight, scale)
    n, k = weight.shape
    check_gated(n, gated)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n // 2 if gated else n)
    gemv = use_gemv(x, m, kernel)
    if gemv:
        mma = m <= MAX_M and mma_gemv_ok(x2, k, group)
        fma = fma_gemv_ok(x2, weight, group)
        prefer_mma = fp8_gemv == "mma" or (fp8_gemv == "auto" and m == 2)
        if fma and not (mma and prefer_mma):
            return fp8_gemv_fma(x2, weight, scale, group, gated=gated, pdl=pdl).reshape(
                *x.shape[:-1], -1)
    if gated:
        return silu_and_mul_triton(fp8_matmul_triton(x, weight, scale, use_scaled_mm, kernel,
                                                     fp8_gemv=fp8_gemv, pdl=pdl))
    if (not gemv and kernel is None and use_scaled_mm and scale.shape[1] == 1
            and _scaled_mm_ok(x2, weight)):
        return _scaled_mm(x2, weight, scale).reshape(*x.shape[:-1], n)
    if gemv and mma:
        return fp8_gemv_mma(x2, weight, scale, group).reshape(*x.shape[:-1], n)
    # the GEMM: prefill, and decode shapes neither GEMV takes
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn = _gemm_tiles(x, m, n, None, None)
    bk = 64 if x.is_cuda else min(triton.next_power_of_2(k), 1024)
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, weight, scale, out, m, n, k, x2.stride(0), weight.stride(0), scale.stride(0),
        out.stride(0), group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=3,
    )
    return out.reshape(*x.shape[:-1], n)
