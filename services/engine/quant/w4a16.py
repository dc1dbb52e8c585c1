"""4-bit integer weights with fp16 group scales and zero points (GPTQ, AWQ), as published.

Rules:
- Parameters are registered under the checkpoint's names (`qweight`, `qzeros`, `scales`, and
  `g_idx` when the checkpoint has one) but in an output-major, unpacked layout: each loader
  unpacks the published tensor (`unpack_*` of the format's config) to codes [N, K] / zeros
  [N, K / G] / scales [N, K / G] and lets the layer narrow it to this rank and fused shard, the same
  way float weights are narrowed.
- `process_after_loading` sorts K by group when g_idx is not trivial (GPTQ act-order; x is then
  read through `perm`) and packs the codes eight to an int32 word, once, in the layout the
  kernel selection's `w4_layout` names (FLOTILLA_W4_LAYOUT): `kmajor` (default) the K-order
  words of kernels/w4a16.py (the fastest batch-1 GEMV; 2-64 rows run kernels/w4a16_mma.py);
  `marlin` the re-packed words of kernels/w4a16_marlin.py (the tensor-core GEMM's operand
  order: faster batched decode; the batch-1 GEMV reads it too, more slowly); `both` keeps
  both copies and serves one row from the K-order words, more rows from the re-packed ones
  (the fastest at every batch, for twice the 4-bit weights' memory). The re-packed layout
  needs K and the group to be multiples of 64; elsewhere the K-order words serve. Measured on
  an H100 (Llama-3-8B shape, docs/benchmarks.md): B16 decode 1.21x, B1 0.58x of kmajor's.
  Off CUDA it dequantizes once and serves float weights.
- Fused shards (q/k/v, gate/up) share their input, so GPTQ gives them the same g_idx; a
  checkpoint where they differ is rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.w4a16 import pack_int4, w4a16_dequantize_ref, w4a16_matmul_triton
from flotilla.kernels.w4a16_marlin import marlin_ok, marlin_pack
from flotilla.services.engine.quant.base import QuantMethod, layer_tensor, linear_2d, use_kernels
from flotilla.services.engine.quant.fp8 import param_loader

Unpack = Callable[[torch.Tensor], torch.Tensor]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_rows(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] packed along rows (8 per word) -> uint8 [8R, C]; row 8r + i is nibble order[i]
    of word r."""
    shifts = (_SHIFTS[list(order)] if order != tuple(range(8)) else _SHIFTS).to(packed.device)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 15
    return codes.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] packed along columns -> uint8 [R, 8C]; column 8c + j is nibble order[j]."""
    shifts = _SHIFTS[list(order)].to(packed.device)
    codes = (packed[:, :, None] >> shifts[None, None, :]) & 15
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


class W4A16LinearMethod(QuantMethod):
    """Storage and matmul of one GPTQ/AWQ layer; the format's config supplies the unpacking."""

    def __init__(self, group_size: int, has_g_idx: bool, unpack_qweight: Unpack,
                 unpack_qzeros: Unpack, zero_offset: int) -> None:
        self.group_size = group_size  # -1: one group per row (per-channel scales)
        self.has_g_idx = has_g_idx
        self.unpack_qweight, self.unpack_qzeros = unpack_qweight, unpack_qzeros
        self.zero_offset = zero_offset  # GPTQ v1 stores zero - 1
        self.kernels = True
        self.marlin = False  # w4_qweight in kernels/w4a16_marlin.py's layout
        self.marlin_rows = False  # w4_marlin: a second copy in that layout for 2+ rows
        self.g_idx_loaded = False

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        g = input_size if self.group_size == -1 else self.group_size
        if input_size % g or g % 8:
            raise ValueError(f"4-bit group size {g} must be a multiple of 8 dividing the "
                             f"per-rank in_features {input_size}")
        self.dtype, self.group = dtype, g
        groups = input_size // g

        def param(shape: tuple[int, ...], dt: torch.dtype, transform: Callable[..., Any]
                  ) -> nn.Parameter:
            p = nn.Parameter(torch.empty(shape, dtype=dt), requires_grad=False)
            p.weight_loader = param_loader(layer, transform)  # type: ignore[attr-defined]
            return p

        layer.qweight = param((output_size, input_size), torch.uint8,
                              lambda t, *s: self.unpack_qweight(t).t())
        layer.qzeros = param((output_size, groups), torch.uint8,
                             lambda t, *s: (self.unpack_qzeros(t) + self.zero_offset).t())
        layer.scales = param((output_size, groups), torch.float16, lambda t, *s: t.t())
        if self.has_g_idx:
            g_idx = nn.Parameter(torch.empty(input_size, dtype=torch.int32), requires_grad=False)
            g_idx.weight_loader = self._load_g_idx  # type: ignore[attr-defined]
            layer.g_idx = g_idx
        # The layer hangs its loader on `weight`; there is no float weight to load.
        layer.register_buffer("weight", torch.empty(0), persistent=False)

    def _load_g_idx(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id: Any) -> None:
        t = loaded.to(torch.int32)
        if t.numel() != param.numel():  # a row-parallel shard of K: groups cross ranks
            raise NotImplementedError("GPTQ g_idx on tensor-parallel row-parallel layers")
        if self.g_idx_loaded and not torch.equal(param.data, t.to(param.device)):
            raise ValueError("fused GPTQ shards have different g_idx (act-order permutations)")
        param.data.copy_(t)
        self.g_idx_loaded = True

    def process_after_loading(self, layer: nn.Module) -> None:
        codes = layer_tensor(layer, "qweight").data & 15
        zeros = layer_tensor(layer, "qzeros").data.clamp(max=16)
        scales = layer_tensor(layer, "scales").data.to(torch.float16)
        perm = None
        if self.has_g_idx:
            g_idx = layer_tensor(layer, "g_idx").data.long()
            perm = self._group_order(g_idx, codes.shape[1])
            del layer.g_idx
        if perm is not None:
            codes = codes[:, perm]
        for name in ("qweight", "qzeros", "scales", "weight"):
            delattr(layer, name)
        self.kernels = use_kernels(codes.device, self.selection.quant_kernels)
        if self.kernels:
            layout = self.selection.w4_layout
            fits = marlin_ok(codes.shape[1], self.group)
            self.marlin = layout == "marlin" and fits
            self.marlin_rows = layout == "both" and fits
            qweight = marlin_pack(codes) if self.marlin else pack_int4(codes)
            layer.register_buffer("w4_qweight", qweight, persistent=False)
            layer.register_buffer("w4_marlin", marlin_pack(codes) if self.marlin_rows else None,
                                  persistent=False)
            layer.register_buffer("w4_scales", scales.contiguous(), persistent=False)
            layer.register_buffer("w4_zeros", zeros.contiguous(), persistent=False)
            layer.register_buffer("w4_perm", None if perm is None else perm.to(torch.int32),
                                  persistent=False)
        else:
            dense = w4a16_dequantize_ref(pack_int4(codes), scales, zeros, self.group)
            if perm is not None:  # back to checkpoint order
                dense = torch.empty_like(dense).index_copy_(1, perm, dense)
            layer.register_buffer("weight_dequant", dense.to(self.dtype), persistent=False)

    def _group_order(self, g_idx: torch.Tensor, k: int) -> torch.Tensor | None:
        """None when g_idx is k // G; else the order that makes each group contiguous."""
        expected = torch.arange(k, device=g_idx.device) // self.group
        if torch.equal(g_idx, expected):
            return None
        perm = torch.sort(g_idx, stable=True).indices
        if not torch.equal(g_idx[perm], expected):
            raise ValueError(f"g_idx does not assign {self.group} input features to each group")
        return perm

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.kernels:
            return F.linear(x, layer_tensor(layer, "weight_dequant"), bias)
        return linear_2d(x, lambda x2: self._matmul(layer, x2, gated=False), bias)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.kernels:
            return super().apply_gated(layer, x)
        return linear_2d(x, lambda x2: self._matmul(layer, x2, gated=True), None)

    def _matmul(self, layer: nn.Module, x2: torch.Tensor, gated: bool) -> torch.Tensor:
        """x2 [M, K] through the copy the layout serves M rows from (see the module rules)."""
        s, z = layer_tensor(layer, "w4_scales"), layer_tensor(layer, "w4_zeros")
        perm = layer.w4_perm
        assert perm is None or isinstance(perm, torch.Tensor)
        marlin = self.marlin or (self.marlin_rows and x2.shape[0] > 1)
        q = layer_tensor(layer, "w4_marlin" if marlin and self.marlin_rows else "w4_qweight")
        return w4a16_matmul_triton(x2, q, s, z, self.group, perm, gated=gated,
                                   pdl=self.selection.pdl, marlin=marlin)


__all__ = ["W4A16LinearMethod", "unpack_cols", "unpack_rows"]
