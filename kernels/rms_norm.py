"""RMSNorm and fused residual-add + RMSNorm over the last dimension.

out = (x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight, statistics in fp32 (HF llama order:
normalise, cast back to the input dtype, then scale). With `round_normed=False` the scale is
applied to the fp32 normalised row and the product is rounded once (HF gpt-oss's
`(weight * x_normed).to(dtype)`): in bf16 the llama order's extra rounding alone moved gpt-oss's
logits 3% further from the fp32 truth than transformers' bf16 run. The fused variant first forms
new_residual = x + residual in x's dtype and normalises that, returning both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from flotilla.kernels.pdl import pdl_args, pdl_wait
from flotilla.kernels.triton_compat import tl, triton


class AddNormOutput(NamedTuple):
    out: torch.Tensor
    residual: torch.Tensor


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 round_normed: bool = True) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:  # one fused op, the same math (CPU decode)
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if not round_normed:
        return (normed * weight.float()).to(x.dtype)
    return (normed.to(x.dtype) * weight).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    round_normed: bool = True,
) -> AddNormOutput:
    new_residual = x + residual
    return AddNormOutput(rms_norm_ref(new_residual, weight, eps, round_normed), new_residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H] input rows, last dim contiguous
    res_ptr,  # [T, H] residual to add first (read only when HAS_RESIDUAL)
    w_ptr,  # [H] weight
    out_ptr,  # [T, H] normalised output, contiguous
    res_out_ptr,  # [T, H] x + residual, contiguous (written only when HAS_RESIDUAL)
    stride_x,  # row stride of x
    stride_res,  # row stride of residual
    hidden,  # H
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= H: one program holds a whole row
    ROUND_NORMED: tl.constexpr = True,  # round x / rms to x's dtype before the scale (llama)
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        # Round the sum to the input dtype first, as the unfused x + residual would.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = xf * rstd
    if ROUND_NORMED:
        normed = normed.to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    round_normed: bool = True, pdl: str = "auto",
) -> AddNormOutput:
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = out
    res2 = x2
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(out)
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 16)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, ROUND_NORMED=round_normed,
            num_warps=num_warps,
            **pdl_args(x2, pdl),
        )
    return AddNormOutput(out, res_out)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    round_normed: bool = True, pdl: str = "auto") -> torch.Tensor:
    return _launch(x, None, weight, eps, round_normed, pdl).out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    round_normed: bool = True, pdl: str = "auto",
) -> AddNormOutput:
    return _launch(x, residual, weight, eps, round_normed, pdl)
