"""MXFP4 experts: the dequantization against transformers' (gpt-oss checkpoints), the quantizer's
round trip, and the fused MoE kernel that decodes MXFP4 tiles in registers against its torch
reference (dequantize + fused_moe_ref)."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.activation import SwigluOAI
from flotilla.kernels.mxfp4_moe import (
    dequantize_mxfp4_ref,
    fused_moe_mxfp4_ref,
    fused_moe_mxfp4_triton,
    quantize_mxfp4_ref,
)
from tests.kernels.conftest import DEVICE, tolerance


def test_dequantize_matches_transformers_gpt_oss_loader() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)  # K = 128
    scales = torch.randint(118, 134, (3, 10, 4), dtype=torch.uint8, generator=g)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    ours = dequantize_mxfp4_ref(blocks.flatten(-2), scales)  # [E, N, K]
    torch.testing.assert_close(ours, ref.transpose(1, 2), atol=0, rtol=0)


def test_quantize_round_trips_values_on_the_grid_and_bounds_the_error() -> None:
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (5, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (5, 4), dtype=torch.uint8, generator=g)
    exact = dequantize_mxfp4_ref(blocks, scales)
    assert torch.equal(dequantize_mxfp4_ref(*quantize_mxfp4_ref(exact)), exact)
    w = torch.randn(6, 96, generator=g) * 3
    err = (dequantize_mxfp4_ref(*quantize_mxfp4_ref(w)) - w).abs().unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.ceil(torch.log2(w.abs().unflatten(-1, (-1, 32)).amax(-1) / 6)))
    assert bool((err <= scale[..., None]).all())  # half the widest FP4 step (4 -> 6)


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
          seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    w13_blocks, w13_scales = quantize_mxfp4_ref(w13)
    w2_blocks, w2_scales = quantize_mxfp4_ref(w2)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k, -1)
    case = dict(x=torch.randn(tokens, hidden, generator=g).to(dtype), w13_blocks=w13_blocks,
                w13_scales=w13_scales, w2_blocks=w2_blocks, w2_scales=w2_scales,
                topk_weights=weights, topk_ids=ids,
                b13=(torch.randn(experts, 2 * inter, generator=g) * 0.1).to(dtype),
                b2=(torch.randn(experts, hidden, generator=g) * 0.1).to(dtype))
    return {k: v.to(DEVICE) for k, v in case.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (1, 64, 32, 4, 2),  # decode: one token
    (11, 96, 64, 6, 3),  # several tiles per expert; K tails of the 64-wide steps
])
@pytest.mark.parametrize("swiglu", [None, SwigluOAI(limit=1.0)])
def test_fused_moe_mxfp4_matches_reference(dtype: torch.dtype, tokens: int, hidden: int,
                                           inter: int, experts: int, top_k: int,
                                           swiglu: SwigluOAI | None) -> None:
    case = _case(tokens, hidden, inter, experts, top_k, dtype)
    out = fused_moe_mxfp4_triton(**case, swiglu=swiglu, block_m=16, block_n=16, block_k=64)
    ref = fused_moe_mxfp4_ref(**case, swiglu=swiglu)
    torch.testing.assert_close(out, ref, **tolerance(dtype, 2.0))


def test_fused_moe_mxfp4_skips_other_ranks_experts() -> None:
    case = _case(6, 64, 32, 4, 2, torch.float32, seed=3)
    local = torch.where(case["topk_ids"] >= 2, case["topk_ids"] - 2, -1)  # rank 1 of 2
    half = {k: (v[2:] if k.startswith(("w", "b")) else v) for k, v in case.items()}
    half["topk_ids"] = local
    out = fused_moe_mxfp4_triton(**half, block_m=16, block_n=16, block_k=32)
    torch.testing.assert_close(out, fused_moe_mxfp4_ref(**half), **tolerance(torch.float32))


def test_fused_moe_mxfp4_rejects_bad_shapes() -> None:
    case = _case(2, 64, 32, 4, 2, torch.float32)
    case["w13_scales"] = case["w13_scales"][:, :, :1].contiguous()  # one group of H's two
    with pytest.raises(ValueError, match="w13_scales"):
        fused_moe_mxfp4_triton(**case)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fused_moe_mxfp4_gpu_realistic(tokens: int) -> None:
    """gpt-oss-20b's expert shapes (hidden 2880, intermediate 2880, 32 experts, top-4), timed."""
    case = _case(tokens, 2880, 2880, 32, 4, torch.bfloat16)
    out = fused_moe_mxfp4_triton(**case, swiglu=SwigluOAI())
    torch.testing.assert_close(out, fused_moe_mxfp4_ref(**case, swiglu=SwigluOAI()),
                               **tolerance(torch.bfloat16, 2.0))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fused_moe_mxfp4_triton(**case, swiglu=SwigluOAI())
    end.record()
    torch.cuda.synchronize()
    print(f"fused_moe_mxfp4 {tokens} tokens: {start.elapsed_time(end) / 10:.3f} ms")
