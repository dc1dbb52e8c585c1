"""Gated MLP activations on x [T, 2I] (gate = x[:, :I], up = x[:, I:]) -> [T, I]:
- SiLU-and-multiply: silu(gate) * up (llama-family SwiGLU);
- gpt-oss's clamped SwiGLU (`SwigluOAI`): gate clamped above at `limit`, up to [-limit, limit],
  then gate * sigmoid(alpha * gate) * (up + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flotilla.kernels.triton_compat import tl, triton


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


@dataclass(frozen=True)
class SwigluOAI:
    """gpt-oss's expert activation (config `swiglu_alpha`, `swiglu_limit`)."""

    alpha: float = 1.702
    limit: float = 7.0


def swiglu_oai_ref(x: torch.Tensor, act: SwigluOAI) -> torch.Tensor:
    half = x.shape[-1] // 2
    gate = x[..., :half].clamp(max=act.limit)
    up = x[..., half:].clamp(min=-act.limit, max=act.limit)
    return gate * torch.sigmoid(gate * act.alpha) * (up + 1)


@triton.jit
def _swiglu_oai_kernel(
    x_ptr,  # [T, 2I], last dim contiguous: gate = x[:, :I], up = x[:, I:]
    out_ptr,  # [T, I] contiguous
    stride_x,  # row stride of x
    inter,  # I
    alpha, limit,
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    out = gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    tl.store(out_ptr + row * inter + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_oai_triton(x: torch.Tensor, act: SwigluOAI) -> torch.Tensor:
    """x [T, 2I] -> [T, I] in x's dtype (computed in fp32)."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"want x [T, 2I] with an even last dim, got {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if x.shape[0] > 0:
        grid = (x.shape[0], triton.cdiv(inter, block))
        _swiglu_oai_kernel[grid](x, out, x.stride(0), inter, act.alpha, act.limit, BLOCK=block,
                                 num_warps=4)
    return out
