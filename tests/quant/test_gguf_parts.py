"""Fused GGUF layers whose tensors have different types (Q4_K_M's Q6_K v_proj) stay quantized.

Reference: each checkpoint tensor decoded by gguf.quants.dequantize, joined, and multiplied by
F.linear in float64; the layer runs its Triton kernels (the interpreter) or its dequantized path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize

from flotilla.kernels.gguf_dequant import Q4_K, Q6_K, Q8_0
from flotilla.kernels.selection import KernelSelection
from flotilla.services.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from flotilla.services.engine.loader import bind_selection
from flotilla.services.engine.quant import GGUFConfig, QuantBytes
from flotilla.services.engine.quant.gguf_parts import GGUFPartsLinearMethod
from flotilla.services.engine.quant.gguf_quantize import quantize_gguf
from tests.quant.conftest import DEVICE, rel_err

PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
          "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
          "up_proj": ("gate_up_proj", 1)}
HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 256, 32, 4, 2


def _blocks(rows: int, qtype: int, seed: int) -> tuple[QuantBytes, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, HIDDEN, generator=gen) * 0.05
    raw = quantize_gguf(w, qtype)
    ref = torch.from_numpy(np.asarray(dequantize(raw.numpy(), qtype), dtype=np.float32))
    return QuantBytes.wrap(raw, qtype), ref.reshape(rows, HIDDEN)


@pytest.mark.parametrize("mode", ["kernels", "dequant"])
def test_qkv_with_a_q6_k_v_proj_keeps_each_part_quantized(mode: str) -> None:
    selection = KernelSelection(quant_kernels="triton" if mode == "kernels" else "torch")
    prefix = "model.layers.0.self_attn"
    types = {f"{prefix}.q_proj.weight": Q4_K, f"{prefix}.k_proj.weight": Q4_K,
             f"{prefix}.v_proj.weight": Q6_K}
    config = GGUFConfig(types, PACKED)
    with torch.device(DEVICE):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False,
                                  quant_config=config, prefix=f"{prefix}.qkv_proj")
    bind_selection(layer, selection)
    assert isinstance(layer.quant_method, GGUFPartsLinearMethod)
    assert config.keeps_quantized(f"{prefix}.v_proj.weight")
    refs = []
    # loaded out of order (v first): the parts are found by row offset, not by arrival
    for seed, (shard, rows) in enumerate((("v", KV_HEADS * HEAD_DIM), ("q", HEADS * HEAD_DIM),
                                          ("k", KV_HEADS * HEAD_DIM))):
        raw, ref = _blocks(rows, types[f"{prefix}.{shard}_proj.weight"], seed)
        layer.weight_loader(layer.weight, raw, shard)
        refs.append((shard, ref))
    layer.quant_method.process_after_loading(layer)
    order = {"q": 0, "k": 1, "v": 2}
    dense = torch.cat([r for _, r in sorted(refs, key=lambda p: order[p[0]])])
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9))
    ours = layer(x.to(DEVICE)).cpu()
    assert not hasattr(layer, "weight")
    if mode == "kernels":
        assert [p[2] for p in layer.quant_method.parts] == [Q4_K, Q6_K]
        assert layer.qweight_0.dtype == torch.uint8 and layer.qweight_0.shape == (
            (HEADS + KV_HEADS) * HEAD_DIM, HIDDEN // 256 * 144)
        assert layer.qweight_1.shape == (KV_HEADS * HEAD_DIM, HIDDEN // 256 * 210)
    assert rel_err(ours, F.linear(x.double(), dense.double())) < 1e-5


def test_gate_up_of_two_types_runs_gated() -> None:
    prefix = "model.layers.0.mlp"
    types = {f"{prefix}.gate_proj.weight": Q8_0, f"{prefix}.up_proj.weight": Q4_K}
    with torch.device(DEVICE):
        layer = MergedColumnParallelLinear(HIDDEN, [64, 64], bias=False,
                                           quant_config=GGUFConfig(types, PACKED),
                                           prefix=f"{prefix}.gate_up_proj")
    bind_selection(layer, KernelSelection(quant_kernels="triton"))
    gate, gate_ref = _blocks(64, Q8_0, 1)
    up, up_ref = _blocks(64, Q4_K, 2)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    layer.quant_method.process_after_loading(layer)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3))
    ours = layer.quant_method.apply_gated(layer, x.to(DEVICE)).cpu()
    ref = F.silu(F.linear(x.double(), gate_ref.double())) * F.linear(x.double(), up_ref.double())
    assert rel_err(ours, ref) < 1e-5


def test_float_tensor_in_a_quantized_part_is_refused() -> None:
    prefix = "model.layers.0.mlp"
    types = {f"{prefix}.gate_proj.weight": Q8_0, f"{prefix}.up_proj.weight": Q4_K}
    layer = MergedColumnParallelLinear(HIDDEN, [64, 64], bias=False,
                                       quant_config=GGUFConfig(types, PACKED),
                                       prefix=f"{prefix}.gate_up_proj")
    with pytest.raises(ValueError, match="expected blocks of Q8_0, Q4_K"):
        layer.weight_loader(layer.weight, torch.zeros(64, HIDDEN), 0)
