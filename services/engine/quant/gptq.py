"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum layout), 4-bit, as published.

Tensors per linear layer: qweight int32 [K / 8, N] packed along K (weight 8r + i in bits 4i of
row r), qzeros int32 [K / G, N / 8] packed along N, scales fp16 [K / G, N], g_idx int32 [K]
(group of each input feature; a permutation of groups with act-order / desc_act). The "gptq"
(v1) checkpoint format stores zero - 1; "gptq_v2" stores the zero itself. Symmetric checkpoints
are the usual case (zero 8); asymmetric ones load the same way. Served by quant/w4a16.py.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

from flotilla.services.engine.quant.base import QuantConfig, QuantMethod, UnquantizedLinearMethod
from flotilla.services.engine.quant.w4a16 import W4A16LinearMethod, unpack_cols, unpack_rows


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, group_size: int = 128, has_g_idx: bool = False, v2: bool = False) -> None:
        self.group_size, self.has_g_idx, self.v2 = group_size, has_g_idx, v2

    @classmethod
    def from_hf(cls, qcfg: dict[str, Any], tensor_names: Collection[str]) -> GPTQConfig:
        bits = qcfg.get("bits", 4)
        if bits != 4:
            raise ValueError(f"GPTQ checkpoints are supported with 4 bits, not {bits}")
        if qcfg.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported")
        has_g_idx = any(n.endswith(".g_idx") for n in tensor_names)
        return cls(int(qcfg.get("group_size", 128)), has_g_idx, fmt == "gptq_v2")

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        if not hasattr(layer, "input_size"):  # the LM head stays float
            return UnquantizedLinearMethod()
        return W4A16LinearMethod(self.group_size, self.has_g_idx, unpack_rows, unpack_cols,
                                 zero_offset=0 if self.v2 else 1)


__all__ = ["GPTQConfig"]
