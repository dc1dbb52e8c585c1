"""GGUF-quantized linear layers: the file's blocks stay quantized in device memory.

Rules:
- The loader decides per tensor, through `GGUFConfig.keeps_quantized`, whether it hands a layer
  raw blocks (a `QuantBytes`: uint8 [rows, row_bytes] that remembers its ggml type through the
  layer's narrowing) or float weights (dequantized by gguf.quants as before).
- A layer keeps blocks when every checkpoint tensor fused into it has a quantized type that the
  kernels decode (kernels/gguf_dequant.py). One type: `GGUFLinearMethod`; a fused layer mixing
  types (Q4_K_M stores some v projections as Q6_K) keeps one block matrix per type
  (quant/gguf_parts.py). An untied LM head (`output.weight`) keeps its blocks too
  (`owns_lm_head_weight`, layers/embedding.py). Norms and the token embedding stay float.
- MoE expert stacks of the kernels' types stay quantized too (quant/gguf_moe.py); MXFP4 stacks
  (gpt-oss) go through quant/mxfp4.py.
- `GGUFLinearMethod` owns `weight` = uint8 [N, K / qk * type_size] (this rank's shard, rows of
  whole blocks) and runs kernels/gguf_matmul.py on CUDA; off CUDA it dequantizes once after
  loading and serves float weights (quant/base.py: use_kernels).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.gguf_dequant import GGUF_TYPES, dequantize_ref, gguf_type
from flotilla.kernels.gguf_matmul import gguf_matmul_triton
from flotilla.services.engine.quant.base import (
    ExpertQuantMethod,
    QuantConfig,
    QuantMethod,
    UnquantizedLinearMethod,
    layer_tensor,
    linear_2d,
    use_kernels,
)
from flotilla.services.engine.quant.gguf_moe import EXPERT_ROLES, GGUFExpertMethod, expert_stack
from flotilla.services.engine.quant.gguf_parts import GGUFPartsLinearMethod
from flotilla.services.engine.quant.mxfp4 import Mxfp4ExpertMethod


class QuantBytes(torch.Tensor):
    """GGUF block bytes whose ggml type survives views (narrow, slicing) and copies."""

    qtype: int

    @staticmethod
    def wrap(data: torch.Tensor, qtype: int) -> QuantBytes:
        out = data.as_subclass(QuantBytes)
        out.qtype = int(qtype)
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, QuantBytes):
            source = next((a for a in args if isinstance(a, QuantBytes)), None)
            if source is not None and hasattr(source, "qtype"):
                out.qtype = source.qtype
        return out


class GGUFLinearMethod(QuantMethod):
    """Weights are GGUF blocks of one ggml type (see the module rules)."""

    def __init__(self, qtype: int, lm_head: bool = False) -> None:
        self.qtype = int(qtype)
        self.type = gguf_type(qtype)
        self.kernels = True
        self.owns_lm_head_weight = lm_head

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        if input_size % self.type.qk:
            raise ValueError(f"{self.type.name} weights need in_features divisible by "
                             f"{self.type.qk} on each rank, got {input_size}")
        self.dtype = dtype
        row_bytes = input_size // self.type.qk * self.type.type_size
        layer.weight = nn.Parameter(torch.empty(output_size, row_bytes, dtype=torch.uint8),
                                    requires_grad=False)

    def load(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        qtype = getattr(src, "qtype", None)
        if qtype != self.qtype:
            found = GGUF_TYPES[qtype].name if qtype in GGUF_TYPES else f"{src.dtype} floats"
            raise ValueError(f"expected {self.type.name} blocks, got {found}")
        super().load(dst, src.as_subclass(torch.Tensor))

    def process_after_loading(self, layer: nn.Module) -> None:
        self.finish(layer, layer_tensor(layer, "weight").data)

    def finish(self, layer: nn.Module, qweight: torch.Tensor) -> None:
        """Keep `qweight` for the kernels, or (off CUDA) replace it by float weights."""
        self.kernels = use_kernels(qweight.device, self.selection.quant_kernels)
        if hasattr(layer, "weight"):
            del layer.weight
        if self.kernels:
            layer.register_buffer("qweight", qweight, persistent=False)
        else:
            dense = dequantize_ref(qweight, self.qtype).to(self.dtype)
            layer.register_buffer("weight_dequant", dense, persistent=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.kernels:
            return F.linear(x, layer_tensor(layer, "weight_dequant"), bias)
        qweight = layer_tensor(layer, "qweight")
        return linear_2d(x, lambda x2: gguf_matmul_triton(x2, qweight, self.qtype,
                                                          pdl=self.selection.pdl), bias)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.kernels:
            return super().apply_gated(layer, x)
        qweight = layer_tensor(layer, "qweight")
        return linear_2d(x, lambda x2: gguf_matmul_triton(x2, qweight, self.qtype, gated=True,
                                                          pdl=self.selection.pdl), None)


class GGUFConfig(QuantConfig):
    """Per-layer choice for a GGUF checkpoint, from the file's tensor types.

    `tensor_types` maps HF checkpoint names to ggml type ids; `packed` is the model's
    `packed_modules_mapping` (checkpoint sub-name -> fused parameter), so the config knows which
    tensors end up in one layer.
    """

    name = "gguf"

    def __init__(self, tensor_types: Mapping[str, int],
                 packed: Mapping[str, tuple[str, str | int]],
                 mxfp4_experts: Collection[str] = (),
                 expert_types: Mapping[str, Mapping[str, int]] | None = None) -> None:
        self.packed = dict(packed)
        self.mxfp4_experts = frozenset(mxfp4_experts)  # MoE expert prefixes stored as MXFP4
        # MoE experts prefix -> role (gate / up / down) -> ggml type of its stack
        self.expert_types = {k: dict(v) for k, v in (expert_types or {}).items()}
        self.quantized_experts: set[str] = set()
        self.param_types: dict[str, set[int]] = {}
        for name, qtype in tensor_types.items():
            self.param_types.setdefault(self.param_name(name), set()).add(int(qtype))
        self.quantized_prefixes: set[str] = set()

    def param_name(self, ckpt_name: str) -> str:
        for ckpt_key, (param_key, _) in self.packed.items():
            if f".{ckpt_key}." in ckpt_name:
                return ckpt_name.replace(f".{ckpt_key}.", f".{param_key}.")
        return ckpt_name

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        types = self.param_types.get(f"{prefix}.weight", set())
        is_linear = hasattr(layer, "input_size")  # LinearBase; the LM head is an embedding
        lm_head = not is_linear and prefix.split(".")[-1] == "lm_head"  # layers/embedding.py
        if lm_head and len(types) == 1 and types <= GGUF_TYPES.keys():
            self.quantized_prefixes.add(prefix)  # an untied output.weight: its blocks
            return GGUFLinearMethod(next(iter(types)), lm_head=True)
        if is_linear and types and types <= GGUF_TYPES.keys():
            self.quantized_prefixes.add(prefix)
            if len(types) == 1:
                return GGUFLinearMethod(next(iter(types)))
            return GGUFPartsLinearMethod(types)
        return UnquantizedLinearMethod()

    def get_expert_method(self, prefix: str) -> ExpertQuantMethod | None:
        """gpt-oss's MXFP4 experts stay MXFP4 (quant/mxfp4.py); stacks of the kernels' types
        stay in their blocks (quant/gguf_moe.py); others are dequantized by the loader."""
        if prefix in self.mxfp4_experts:
            return Mxfp4ExpertMethod()
        types = self.expert_types.get(prefix, {})
        if set(types) == set(EXPERT_ROLES) and set(types.values()) <= GGUF_TYPES.keys():
            self.quantized_experts.add(prefix)
            return GGUFExpertMethod([types[role] for role in EXPERT_ROLES])
        return None

    def keeps_quantized(self, ckpt_name: str) -> bool:
        """Whether the loader should pass this tensor's blocks as they are (for MXFP4 expert
        stacks: repacked as quant/mxfp4.py's blocks and scales)."""
        if any(ckpt_name.startswith(f"{p}.") for p in self.mxfp4_experts):
            return True
        stack = expert_stack(ckpt_name)
        if stack is not None:
            return stack[0] in self.quantized_experts
        pname = self.param_name(ckpt_name)
        return pname.endswith(".weight") and pname[: -len(".weight")] in self.quantized_prefixes


__all__ = ["GGUFConfig", "GGUFLinearMethod", "QuantBytes"]
