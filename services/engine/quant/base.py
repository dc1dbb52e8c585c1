"""Per-layer quantization strategy: how a linear layer stores, loads and applies its weight.

Rules:
- A layer owns one `QuantMethod`, chosen by a `QuantConfig` when the layer is built; model code
  never branches on the quantization scheme. Methods keep the engine's kernel selection
  (`selection`, kernels/selection.py, bound by the loader before the weights load) and hand
  their kernels the fields they need.
- `create_weights` registers the layer's parameters. The layer (not the method) then attaches a
  `weight_loader` to each parameter, because only the layer knows how checkpoint tensors map onto
  its tensor-parallel shard and its fused (q/k/v, gate/up) sub-blocks.
- `load` copies one checkpoint tensor, already narrowed to the destination's shard, into the
  destination view of a parameter.
- `process_after_loading` runs once after every weight is loaded (repack, quantize, drop the
  float copy). After it, `apply` is the only way the layer's weight is used.
- `apply(layer, x, bias)` computes `x @ W.T (+ bias)` in `x.dtype`.
- Quantized formats (GGUF blocks, GPTQ/AWQ int4, fp8) keep their packed weights and run Triton
  kernels when the weights live on CUDA; elsewhere they dequantize once after loading and serve
  float weights. The kernel selection's quant_kernels (kernels/selection.py,
  FLOTILLA_QUANT_KERNELS) `triton` forces the kernels (on CPU: the Triton interpreter, for
  tests), `torch` forces the dequantized path.
- Unquantized weights multiply through cuBLAS (F.linear), except decode-sized inputs on CUDA
  under the selection's GEMV backend (`gemv`, FLOTILLA_GEMV): `auto` (default) kernels/gemv.py
  for one row of 16-bit x (batch-1 decode), F.linear otherwise; `triton` kernels/gemv.py for
  M <= TRITON_GEMV_MAX_M rows; `cublas` always F.linear. H200 sweep (bench/gemv_sweep.py,
  Llama-3-8B matrices, CUDA-graph replays from HBM): at M=1 ours took 14.3 / 10.4 / 56.1 / 28.7 us
  for q/k/v, o, gate_up, down against cuBLAS's 16.3 / 13.5 / 56.6 / 32.3 (B1 212 -> 229 tok/s);
  at M=2..8 cuBLAS wins (15.5 / 13.4 / 56.3 / 32.2 against 17.4 / 13.2 / 60.0 / 36.7).
- A gated MLP's bias-free [gate; up] projection (`apply_gated`) of at least GATED_GEMM_MIN_ROWS
  16-bit rows on a Hopper-or-later GPU runs kernels/gated_gemm.py, which stores
  silu(gate) * up from the GEMM's epilogue (the selection's gated_gemm, FLOTILLA_GATED_GEMM:
  auto | 0 | 1). H100, Llama-3-8B, 4,096 tokens in the engine: 1.316 ms a layer against
  cuBLAS 1.256 + SiLU·mul 0.118; below ~1,024 rows cuBLAS + the kernel is as fast or faster. If
  the kernel fails to build (Triton's warp specialisation), the process logs it once and keeps
  the cuBLAS path.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.kernels.gated_gemm import gated_gemm_ok, gated_gemm_triton
from flotilla.kernels.gemv import gemv_triton
from flotilla.kernels.selection import Selecting
from flotilla.kernels.triton_compat import HAVE_TRITON

TRITON_GEMV_MAX_M = 8  # `triton`: decode batches the Triton GEMV serves (graph buckets 1-8)
AUTO_GEMV_MAX_M = 1  # `auto`: where it beats cuBLAS (module rules)
GATED_GEMM_MIN_ROWS = 1024  # below: cuBLAS + SiLU·mul (as fast or faster; decode graphs too)
# the fused gate/up GEMM in this process: None not tried yet, True built and ran, False failed
# to build (the cuBLAS path from then on)
_gated_gemm_built: bool | None = None
log = logging.getLogger(__name__)


class QuantMethod(ABC, Selecting):
    """Storage and matmul strategy of one linear-like layer (see the module rules)."""

    # The LM head (layers/embedding.py) calls create_weights / load for its weight (GGUF blocks)
    # instead of keeping the float embedding-layout weight.
    owns_lm_head_weight: bool = False

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        """Register `weight` [output_size, input_size] (this rank's shard) on `layer`."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                    requires_grad=False)

    def load(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(src.shape)} does not match "
                             f"parameter shard {tuple(dst.shape)}")
        dst.copy_(src)

    def process_after_loading(self, layer: nn.Module) -> None:
        return None

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def apply_gated(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(x gate^T) * (x up^T) for a bias-free [gate; up] weight (a gated MLP's projection
        and activation). Methods whose decode GEMV stores the activation itself override this
        (kernels/gemv_rows.py: one launch less per layer and step)."""
        return kernels.silu_and_mul(self.apply(layer, x), selection=self.selection)


class UnquantizedLinearMethod(QuantMethod):
    """Plain float weight in the model dtype."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight, sel = layer_tensor(layer, "weight"), self.selection
        if x.is_cuda and use_triton_gemv(x, weight, sel.gemv):
            return linear_2d(x, lambda x2: gemv_triton(x2, weight, pdl=sel.pdl), bias)
        return F.linear(x, weight, bias)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight, sel = layer_tensor(layer, "weight"), self.selection
        if x.is_cuda and use_triton_gemv(x, weight, sel.gemv):
            return linear_2d(x, lambda x2: gemv_triton(x2, weight, gated=True, pdl=sel.pdl),
                             None)
        if use_gated_gemm(x, weight, sel.gated_gemm):
            out = _gated_gemm(x, weight)
            if out is not None:
                return out
        return super().apply_gated(layer, x)


def use_gated_gemm(x: torch.Tensor, weight: torch.Tensor, mode: str = "auto") -> bool:
    """Whether a gated projection runs kernels/gated_gemm.py (SiLU·mul in the GEMM's epilogue).
    `mode`, the selection's gated_gemm (FLOTILLA_GATED_GEMM): auto (default) for 16-bit inputs of
    at least GATED_GEMM_MIN_ROWS rows on Hopper or later GPUs; 1 for any CUDA input the kernel
    takes; 0 never. Off for the process once its kernel fails to build here
    (`_gated_gemm_built`)."""
    if mode == "0" or _gated_gemm_built is False or not x.is_cuda or not HAVE_TRITON:
        return False
    if mode == "auto" and (x.numel() // max(1, x.shape[-1]) < GATED_GEMM_MIN_ROWS
                           or torch.cuda.get_device_capability(x.device)[0] < 9):
        return False  # decode-sized steps leave here, before the layout checks
    return gated_gemm_ok(x, weight)


def _gated_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The fused gate/up GEMM, or None if its kernel cannot be built here (Triton's warp
    specialisation fails on some builds): logged once, then the cuBLAS path for good."""
    global _gated_gemm_built
    if _gated_gemm_built:  # later errors are real ones: raise them
        return gated_gemm_triton(x, weight)
    try:
        out = gated_gemm_triton(x, weight)
    except RuntimeError as exc:  # a compile failure (MLIR pass, ptxas), not a wrong answer
        log.warning("fused gate/up GEMM unavailable (%s); cuBLAS + SiLU·mul instead",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        _gated_gemm_built = False
        return None
    _gated_gemm_built = True
    return out


def use_triton_gemv(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> bool:
    """Whether an unquantized x @ weight.T runs kernels/gemv.py under the selection's gemv
    `backend` (see the module rules)."""
    if backend == "cublas" or not HAVE_TRITON or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    if weight.dtype != x.dtype or weight.stride(-1) != 1:
        return False
    return rows <= (TRITON_GEMV_MAX_M if backend == "triton" else AUTO_GEMV_MAX_M)


class ExpertQuantMethod(ABC, Selecting):
    """Storage and compute of a MoE layer's stacked experts (layers/moe.py MoEExperts) in a
    quantized format: `create_weights` registers the parameters of one stack (w13 or w2; the
    stack attaches its per-expert weight_loader to each), `process_after_loading` runs once
    after loading (keep the packed weights for the kernels, or dequantize), `apply` runs the
    experts for this rank's top-k pairs (on the tensors' device: an offloaded expert set,
    layers/moe_offload.py, is a second instance whose tensors live on the CPU).
    `takes_input_weight`: `apply` honours the experts' `weight_on_input` (llama4)."""

    takes_input_weight: bool = False

    @abstractmethod
    def create_weights(self, stack: nn.Module, num_local: int, out_size: int,
                       in_size: int) -> None: ...

    def load(self, stack: nn.Module, dst: torch.Tensor, loaded: torch.Tensor, part: int) -> None:
        """Copy one expert's row block `part` of a stack's `weight` (dst: its rows there)."""
        if dst.shape != loaded.shape:
            raise ValueError(f"expert tensor shape {tuple(loaded.shape)} does not match "
                             f"{tuple(dst.shape)}")
        dst.copy_(loaded)

    def process_after_loading(self, experts: nn.Module) -> None:
        return None

    @abstractmethod
    def apply(self, experts: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor: ...


class QuantConfig(ABC):
    """Chooses the `QuantMethod` of each layer; `prefix` is the layer's dotted module name."""

    name: str = "none"

    @abstractmethod
    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod: ...

    def get_expert_method(self, prefix: str) -> ExpertQuantMethod | None:
        """How the stacked experts of the MoE layer `prefix` are stored; None: float weights
        (the default: a config quantizes linear layers, shared experts included)."""
        return None


class UnquantizedConfig(QuantConfig):
    name = "none"

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod()


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """A parameter or buffer of `layer`, typed as a tensor."""
    return cast(torch.Tensor, getattr(layer, name))


def use_kernels(device: torch.device, mode: str = "auto") -> bool:
    """Whether quantized layers on `device` run their Triton kernels under the selection's
    quant_kernels `mode` (see the module rules)."""
    return HAVE_TRITON and (mode == "triton" or (mode == "auto" and device.type == "cuda"))


def linear_2d(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
              bias: torch.Tensor | None) -> torch.Tensor:
    """fn(x as [M, K]) -> [M, N], reshaped back to x's leading dims, plus the bias."""
    y = fn(x.reshape(-1, x.shape[-1]))
    y = y.reshape(*x.shape[:-1], y.shape[-1])  # explicit N: a step may have 0 rows here
    return y if bias is None else y + bias


def get_quant_method(config: QuantConfig | None, layer: nn.Module, prefix: str) -> QuantMethod:
    return (config or UnquantizedConfig()).get_method(layer, prefix)
