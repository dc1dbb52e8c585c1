"""CPU int4 weight-only layers (quant/int4.py) against gguf's own Q4_1 and a float matmul."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from flotilla.services.engine.quant.int4 import Int4WeightOnlyMethod, quantize_groups


def q4_1_weights(n: int, k: int) -> torch.Tensor:
    """Float weights on gguf's Q4_1 grid (quantized and dequantized by the gguf package)."""
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    t = GGMLQuantizationType.Q4_1
    return torch.from_numpy(dequantize(quantize(w, t), t).reshape(n, k).copy())


def test_int4_groups_hold_q4_1_exactly() -> None:
    w = q4_1_weights(16, 128)
    q, scale, offset = quantize_groups(w)
    back = q.reshape(16, 4, 32).float() * scale[..., None] + offset[..., None]
    torch.testing.assert_close(back.reshape(16, 128), w, rtol=0, atol=1e-6)


def test_int4_linear_matches_float_matmul() -> None:
    w = q4_1_weights(96, 64)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    method = Int4WeightOnlyMethod()
    method.process_after_loading(layer)
    assert not hasattr(layer, "weight")
    x = torch.randn(3, 64)
    out = method.apply(layer, x)
    ref = x @ w.T
    # bf16 activations and scales: ~0.5% relative error, not 4-bit error (that is 10x larger).
    assert float((out - ref).norm() / ref.norm()) < 0.01


def test_weight_only_linears_take_a_step_with_no_rows() -> None:
    """A step whose only request is a non-final prefill chunk computes logits for 0 rows."""
    from flotilla.services.engine.quant.int8 import Int8WeightOnlyMethod

    for method in (Int4WeightOnlyMethod(), Int8WeightOnlyMethod()):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(q4_1_weights(96, 64), requires_grad=False)
        method.process_after_loading(layer)
        assert method.apply(layer, torch.randn(0, 64)).shape == (0, 96)
