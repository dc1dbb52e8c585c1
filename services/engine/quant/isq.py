"""In-situ quantization (`--isq NAME`): float checkpoint weights are quantized while loading.

Rules:
- Every linear layer and the LM head load float weights as usual; `process_after_loading`
  quantizes each one where it lives (on the GPU: seconds for an 8B model) and drops the float
  copy. Embeddings and norms stay float. A tied LM head quantizes its own view; the embedding
  keeps the float table.
- GGUF names (q4_0 .. q6k) produce GGUF blocks (services/engine/quant/gguf_quantize.py) served by
  the GGUF kernels; a k-quant layer whose in_features is not a multiple of 256 takes the nearest
  32-weight type (q4k -> Q4_1, q6k -> Q8_0, ...); `fp8` produces e4m3 weights with
  per-channel scales (quant/fp8.py).
- One progress bar counts the quantized layers.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from tqdm import tqdm

from flotilla.kernels.fp8 import quantize_fp8_per_channel
from flotilla.kernels.gguf_dequant import (
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    gguf_type,
)
from flotilla.services.engine.quant.base import QuantConfig, QuantMethod, layer_tensor
from flotilla.services.engine.quant.fp8 import FP8LinearMethod
from flotilla.services.engine.quant.gguf import GGUFLinearMethod
from flotilla.services.engine.quant.gguf_quantize import quantize_gguf

ISQ_GGUF_TYPES = {"q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q5_1": Q5_1, "q8_0": Q8_0,
                  "q2k": Q2_K, "q3k": Q3_K, "q4k": Q4_K, "q5k": Q5_K, "q6k": Q6_K}
ISQ_NAMES = (*ISQ_GGUF_TYPES, "fp8")
# k-quants need in_features % 256 == 0; other layers take the nearest 32-weight type, as
# llama.cpp's quantizer does.
_FALLBACK = {Q2_K: Q4_0, Q3_K: Q4_0, Q4_K: Q4_1, Q5_K: Q5_1, Q6_K: Q8_0}


class _Progress:
    """Counts quantized layers on one bar, opened by the first and closed by the last."""

    def __init__(self, name: str) -> None:
        self.name, self.total, self.done = name, 0, 0
        self.bar: tqdm | None = None

    def step(self) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total, desc=f"quantizing ({self.name})", unit="layer",
                            disable=None, file=sys.stderr)
        self.done += 1
        self.bar.update(1)
        if self.done >= self.total:
            self.bar.close()


def _take_float_weight(layer: nn.Module) -> torch.Tensor:
    weight = layer_tensor(layer, "weight").data
    del layer.weight  # a tied embedding keeps its own reference
    return weight


class _FloatWeightsIn:
    """Mixin for in-situ methods: the checkpoint holds float weights, so creation and loading are
    the plain float ones (QuantMethod's); quantization happens in process_after_loading."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        QuantMethod.create_weights(self, layer, input_size, output_size, dtype)  # type: ignore[arg-type]

    def load(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        QuantMethod.load(self, dst, src)  # type: ignore[arg-type]


class ISQGGUFMethod(_FloatWeightsIn, GGUFLinearMethod):
    """Float weights in, GGUF blocks of `qtype` out."""

    def __init__(self, qtype: int, progress: _Progress) -> None:
        super().__init__(qtype)
        self.progress = progress

    def process_after_loading(self, layer: nn.Module) -> None:
        weight = _take_float_weight(layer)
        self.dtype = weight.dtype
        k = weight.shape[1]
        qtype = self.qtype if k % self.type.qk == 0 else _FALLBACK.get(self.qtype)
        if qtype is None or k % 32:
            raise ValueError(f"--isq {self.type.name}: in_features {k} is not a multiple of 32")
        self.qtype, self.type = qtype, gguf_type(qtype)
        self.finish(layer, quantize_gguf(weight, qtype))
        self.progress.step()


class ISQFP8Method(_FloatWeightsIn, FP8LinearMethod):
    """Float weights in, e4m3 weights with per-channel scales out."""

    def __init__(self, progress: _Progress) -> None:
        super().__init__(None)
        self.progress = progress

    def process_after_loading(self, layer: nn.Module) -> None:
        weight = _take_float_weight(layer)
        self.dtype = weight.dtype
        self.finish(layer, *quantize_fp8_per_channel(weight))
        self.progress.step()


class ISQConfig(QuantConfig):
    """Quantizes every linear layer and the LM head to one type (`name` in ISQ_NAMES)."""

    def __init__(self, name: str) -> None:
        if name not in ISQ_NAMES:
            raise ValueError(f"unknown --isq {name!r}; supported: {', '.join(ISQ_NAMES)}")
        self.name = name
        self.progress = _Progress(name)

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        self.progress.total += 1
        if self.name == "fp8":
            return ISQFP8Method(self.progress)
        return ISQGGUFMethod(ISQ_GGUF_TYPES[self.name], self.progress)


__all__ = ["ISQ_NAMES", "ISQConfig", "ISQFP8Method", "ISQGGUFMethod"]
