"""A fused GGUF layer whose checkpoint tensors have different quantized types, kept quantized.

Rules:
- llama.cpp's mixed recipes (Q4_K_M, Q5_K_M, ...) store some tensors of a fused layer in a wider
  type (v_proj or a gate/up half as Q6_K beside Q4_K q/k). Each such layer keeps one block matrix
  per run of rows of one type ("part"): nothing is dequantized to float, no bytes are re-encoded.
- While loading, `weight` is uint8 [N, widest row_bytes]; each checkpoint tensor lands in its rows
  (the layer narrows them: its row offset is read off the destination view) and fills the first
  row_bytes of its type. After loading, adjacent rows of one type become one part, a contiguous
  uint8 [rows, row_bytes] buffer (`qweight_{i}`), and the padded matrix is freed.
- `apply` runs kernels/gguf_matmul.py once per part and concatenates the outputs along N
  (gated [gate; up] layers: silu(gate) * up of the joined result). Off CUDA (quant/base.py
  use_kernels) the parts are dequantized once and joined into one float weight, as
  GGUFLinearMethod does.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.kernels.gguf_dequant import GGUF_TYPES, dequantize_ref, gguf_type
from flotilla.kernels.gguf_matmul import gguf_matmul_triton
from flotilla.services.engine.quant.base import QuantMethod, layer_tensor, linear_2d, use_kernels


class GGUFPartsLinearMethod(QuantMethod):
    """Weights are GGUF blocks of several ggml types, one per row range (see the module rules)."""

    def __init__(self, qtypes: Collection[int]) -> None:
        self.qtypes = frozenset(int(t) for t in qtypes)
        for t in self.qtypes:
            gguf_type(t)  # raises for a type without kernels
        self.kernels = True
        self.parts: list[tuple[int, int, int]] = []  # (first row, rows, qtype) after loading
        self._loaded: list[tuple[int, int, int]] = []

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        for t in self.qtypes:
            if input_size % GGUF_TYPES[t].qk:
                raise ValueError(f"{GGUF_TYPES[t].name} weights need in_features divisible by "
                                 f"{GGUF_TYPES[t].qk} on each rank, got {input_size}")
        self.dtype = dtype
        self.input_size = input_size
        widest = max(input_size // GGUF_TYPES[t].qk * GGUF_TYPES[t].type_size
                     for t in self.qtypes)
        self.weight = nn.Parameter(torch.zeros(output_size, widest, dtype=torch.uint8),
                                   requires_grad=False)
        layer.weight = self.weight

    def load(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        qtype = getattr(src, "qtype", None)
        if qtype not in self.qtypes:
            found = GGUF_TYPES[qtype].name if qtype in GGUF_TYPES else f"{src.dtype} floats"
            want = ", ".join(GGUF_TYPES[t].name for t in sorted(self.qtypes))
            raise ValueError(f"expected blocks of {want}, got {found}")
        row_bytes = self.input_size // GGUF_TYPES[qtype].qk * GGUF_TYPES[qtype].type_size
        if src.dim() != 2 or src.shape != (dst.shape[0], row_bytes):
            raise ValueError(f"checkpoint blocks {tuple(src.shape)} do not fit "
                             f"{dst.shape[0]} rows of {row_bytes} bytes")
        first = (dst.data_ptr() - self.weight.data_ptr()) // self.weight.stride(0)
        dst[:, :row_bytes].copy_(src.as_subclass(torch.Tensor))
        self._loaded.append((int(first), int(dst.shape[0]), int(qtype)))

    def process_after_loading(self, layer: nn.Module) -> None:
        parts: list[tuple[int, int, int]] = []
        for first, rows, qtype in sorted(set(self._loaded)):
            if parts and parts[-1][0] + parts[-1][1] == first and parts[-1][2] == qtype:
                parts[-1] = (parts[-1][0], parts[-1][1] + rows, qtype)
            else:
                parts.append((first, rows, qtype))
        covered = sum(rows for _, rows, _ in parts)
        if covered != self.weight.shape[0] or (parts and parts[0][0] != 0):
            raise ValueError(f"GGUF parts cover {covered} of {self.weight.shape[0]} rows")
        self.parts = parts
        padded = layer_tensor(layer, "weight").data
        del layer.weight
        del self.weight
        self.kernels = use_kernels(padded.device, self.selection.quant_kernels)
        blocks = []
        for first, rows, qtype in parts:
            t = GGUF_TYPES[qtype]
            blocks.append(padded[first:first + rows, :self.input_size // t.qk * t.type_size]
                          .contiguous())
        if self.kernels:
            for i, qweight in enumerate(blocks):
                layer.register_buffer(f"qweight_{i}", qweight, persistent=False)
        else:
            dense = torch.cat([dequantize_ref(b, qtype) for b, (_, _, qtype) in
                               zip(blocks, parts, strict=True)]).to(self.dtype)
            layer.register_buffer("weight_dequant", dense, persistent=False)

    def _matmul(self, layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
        return torch.cat([gguf_matmul_triton(x2, layer_tensor(layer, f"qweight_{i}"), qtype,
                                             pdl=self.selection.pdl)
                          for i, (_, _, qtype) in enumerate(self.parts)], dim=-1)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.kernels:
            return F.linear(x, layer_tensor(layer, "weight_dequant"), bias)
        return linear_2d(x, lambda x2: self._matmul(layer, x2), bias)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(self.apply(layer, x), selection=self.selection)


__all__ = ["GGUFPartsLinearMethod"]
