"""AWQ checkpoints (AutoAWQ "gemm" layout), 4-bit, as published.

Tensors per linear layer: qweight int32 [K, N / 8] packed along N, qzeros int32 [K / G, N / 8]
packed the same way, scales fp16 [K / G, N]; w = (q - zero) * scale. AutoAWQ interleaves the
columns of each word: nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i], so column 8c + j
sits in nibble AWQ_ORDER[j]. Served by quant/w4a16.py.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import partial
from typing import Any

from torch import nn

from flotilla.services.engine.quant.base import QuantConfig, QuantMethod, UnquantizedLinearMethod
from flotilla.services.engine.quant.w4a16 import W4A16LinearMethod, unpack_cols

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_unpack = partial(unpack_cols, order=AWQ_ORDER)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, group_size: int = 128, skip: Collection[str] = ()) -> None:
        self.group_size, self.skip = group_size, set(skip)

    @classmethod
    def from_hf(cls, qcfg: dict[str, Any], tensor_names: Collection[str]) -> AWQConfig:
        bits = qcfg.get("bits", qcfg.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ checkpoints are supported with 4 bits, not {bits}")
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only 'gemm')")
        if not qcfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points are not supported")
        group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        return cls(group, qcfg.get("modules_to_not_convert") or ())

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        skipped = any(s in prefix for s in self.skip)
        if not hasattr(layer, "input_size") or skipped:
            return UnquantizedLinearMethod()
        return W4A16LinearMethod(self.group_size, False, _unpack, _unpack, zero_offset=0)


__all__ = ["AWQ_ORDER", "AWQConfig"]
