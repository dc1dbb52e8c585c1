"""Fused MoE over GGUF-quantized experts (kernels/gguf_moe.py) against an independent reference:
each expert's blocks decoded by gguf.quants.dequantize, then the torch MoE (fused_moe_ref)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from flotilla.kernels.fused_moe import fused_moe_ref
from flotilla.kernels.gguf_dequant import (
    GGUF_TYPES,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
)
from flotilla.kernels.gguf_moe import QuantPart, fused_moe_gguf_ref, fused_moe_gguf_triton
from flotilla.services.engine.quant.gguf_quantize import quantize_gguf
from tests.kernels.conftest import DEVICE

E, H, INTER, TOP_K = 4, 256, 256, 2


def _stack(rows: int, cols: int, qtype: int, seed: int) -> tuple[QuantPart, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(E * rows, cols, generator=gen) * 0.1
    raw = quantize_gguf(w, qtype)
    ref = np.asarray(dequantize(raw.numpy(), qtype), dtype=np.float32).reshape(E, rows, cols)
    return (QuantPart(raw.reshape(E, rows, -1).contiguous().to(DEVICE), qtype),
            torch.from_numpy(ref).to(DEVICE))


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen).softmax(-1)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize(("gate_t", "up_t", "down_t"), [
    (Q4_K, Q4_K, Q6_K),  # Q4_K_M's experts
    (Q5_K, Q5_K, Q5_K),
    (Q8_0, Q8_0, Q8_0),
    (Q4_K, Q6_K, Q4_0),  # gate and up of different types: two parts of w13
])
@pytest.mark.parametrize("tokens", [1, 5])
def test_quantized_experts_match_gguf_dequantize_and_torch_moe(
        gate_t: int, up_t: int, down_t: int, tokens: int) -> None:
    gate, gate_ref = _stack(INTER, H, gate_t, 1)
    up, up_ref = _stack(INTER, H, up_t, 2)
    down, down_ref = _stack(H, INTER, down_t, 3)
    w13 = [gate, up] if gate_t != up_t else [
        QuantPart(torch.cat([gate.blocks, up.blocks], dim=1), gate_t)]
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    weights, ids = _routing(tokens, 5)
    ref = fused_moe_ref(x.double(), torch.cat([gate_ref, up_ref], 1).double(),
                        down_ref.double(), weights.double(), ids)
    ours = fused_moe_gguf_triton(x, w13, [down], weights, ids)
    torch.testing.assert_close(ours.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_moe_gguf_ref(x, w13, [down], weights, ids).double(), ref,
                               atol=1e-4, rtol=1e-4)


def test_other_ranks_experts_add_nothing() -> None:
    w13, w13_ref = _stack(2 * INTER, H, Q4_K, 6)
    down, down_ref = _stack(H, INTER, Q8_0, 7)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    weights, ids = _routing(3, 9)
    ids[0, 1] = -1  # routed to an expert this rank does not own
    ids[2] = -1
    ref = fused_moe_ref(x.double(), w13_ref.double(), down_ref.double(), weights.double(), ids)
    ours = fused_moe_gguf_triton(x, [w13], [down], weights, ids)
    assert bool((ours[2] == 0).all())
    torch.testing.assert_close(ours.double(), ref, atol=1e-4, rtol=1e-4)


def test_bf16_activations() -> None:
    w13, w13_ref = _stack(2 * INTER, H, Q4_K, 10)
    down, down_ref = _stack(H, INTER, Q6_K, 11)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    weights, ids = _routing(4, 13)
    ref = fused_moe_ref(x.double(), w13_ref.double(), down_ref.double(), weights.double(), ids)
    ours = fused_moe_gguf_triton(x.bfloat16(), [w13], [down], weights, ids)
    assert ours.dtype == torch.bfloat16
    err = float((ours.double() - ref).norm() / ref.norm())
    assert err < 2e-2, err


def test_shapes_are_checked() -> None:
    w13, _ = _stack(2 * INTER, H, Q4_K, 14)
    down, _ = _stack(H, INTER, Q4_K, 15)
    x = torch.randn(2, H).to(DEVICE)
    weights, ids = _routing(2, 16)
    with pytest.raises(ValueError, match="do not fit hidden size"):
        fused_moe_gguf_triton(x, [w13], [QuantPart(down.blocks[:, :128].contiguous(), Q4_K)],
                              weights, ids)


def _random_stack(rows: int, cols: int, qtype: int, seed: int) -> tuple[QuantPart, torch.Tensor]:
    """Random block bytes (every code / scale / sign pattern) with small finite f16 scales."""
    from tests.quant.test_gguf_kernels import gguf_reference, random_blocks

    t = GGUF_TYPES[qtype]
    raw = random_blocks(qtype, E * rows, cols // t.qk, seed)
    ref = gguf_reference(raw, qtype).reshape(E, rows, cols)
    return (QuantPart(torch.from_numpy(raw).reshape(E, rows, -1).contiguous().to(DEVICE), qtype),
            ref.to(DEVICE))


@pytest.mark.parametrize(("w13_t", "down_t"), [(IQ2_XXS, IQ4_XS), (IQ3_S, IQ2_S),
                                               (IQ4_NL, IQ3_XXS), (IQ2_XS, Q5_K)])
def test_i_quant_experts_match_gguf_dequantize(w13_t: int, down_t: int) -> None:
    w13, w13_ref = _random_stack(2 * INTER, H, w13_t, 17)
    down, down_ref = _random_stack(H, INTER, down_t, 18)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(19)).to(DEVICE)
    weights, ids = _routing(3, 20)
    ref = fused_moe_ref(x.double(), w13_ref.double(), down_ref.double(), weights.double(), ids)
    ours = fused_moe_gguf_triton(x, [w13], [down], weights, ids)
    err = float((ours.double() - ref).norm() / ref.norm())
    assert err < 1e-5, err
