"""SiLU-and-multiply, the gated MLP activation: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in `dtype` from fp32 (or `dtype`) gate and up, rounded as torch's
    silu(gate) * up on `dtype` tensors: inputs, silu and product each rounded to `dtype`."""
    g = gate.to(dtype).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
    return (act * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I], last dim contiguous: gate = x[:, :I], up = x[:, I:]
    out_ptr,  # [T, I] contiguous
    stride_x,  # row stride of x
    inter,  # I
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * inter + offs, silu_mul(gate, up, out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4)
    return out
