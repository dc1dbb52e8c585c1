"""FP8 (e4m3) weights: pre-quantized checkpoints and the target of `--isq fp8`.

Rules:
- Served layout: `weight_fp8` e4m3 [N, K] and `weight_scale` float32 [N, G] (per output channel:
  G = 1; 2D blocks: one row of K-block scales per weight row), run by kernels/fp8.py on CUDA;
  off CUDA the layer dequantizes once after loading.
- Checkpoints (config.json `quantization_config`), read as published:
  * quant_method "fp8" with `weight_scale` (per tensor, AutoFP8) or `weight_scale_inv` blocks
    (`weight_block_size`, DeepSeek/Qwen FP8);
  * quant_method "compressed-tensors" with 8-bit float weights, strategy tensor / channel / block.
  Per-tensor scales of fused shards become per-channel scales of their rows; block scales are
  repeated over the rows of their block.
  Static `input_scale`s are accepted and unused: activations are quantized dynamically per token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.fp8 import FP8, fp8_dequantize_ref, fp8_matmul_triton
from flotilla.services.engine.quant.base import (
    QuantConfig,
    QuantMethod,
    UnquantizedLinearMethod,
    layer_tensor,
    linear_2d,
    use_kernels,
)


def checkpoint_rows(layer: nn.Module, shard_id: Any = None) -> int:
    """Rows of the full checkpoint tensor that `layer` loads as `shard_id`."""
    from flotilla.services.engine.layers.linear import (  # layers import quant: import here
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )

    tp = getattr(layer, "tp_size", 1)
    if isinstance(layer, QKVParallelLinear):
        if shard_id == "q":
            return layer.num_heads * layer.head_dim * tp
        return layer.num_kv_heads * tp // layer.kv_replicas * layer.head_dim
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard_id]
    if isinstance(layer, ColumnParallelLinear):
        return layer.output_size * tp
    return int(layer.output_size)  # type: ignore[arg-type]


def param_loader(layer: nn.Module, transform: Callable[..., torch.Tensor]
                 ) -> Callable[..., None]:
    """A weight_loader that reshapes the checkpoint tensor (transform(loaded, *shard_id)) into the
    parameter's output-major layout and lets the layer narrow it to this rank and shard."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *shard_id: Any) -> None:
        layer.weight_loader(param, transform(loaded, *shard_id), *shard_id)  # type: ignore

    return load


def _ignore(param: nn.Parameter, loaded: torch.Tensor, *shard_id: Any) -> None:
    return None


class FP8LinearMethod(QuantMethod):
    """Checkpoint e4m3 weights + scales in; per-channel e4m3 served (see the module rules)."""

    def __init__(self, config: FP8Config | None) -> None:
        self.config = config
        self.kernels = True

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        assert self.config is not None
        cfg = self.config
        self.dtype = dtype
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8),
                                    requires_grad=False)
        if cfg.block is None:
            scale = nn.Parameter(torch.empty(output_size, 1), requires_grad=False)

            def per_row(loaded: torch.Tensor, *shard: Any) -> torch.Tensor:
                t = loaded.float().reshape(-1, 1)
                return t.expand(checkpoint_rows(layer, *shard), 1) if t.numel() == 1 else t

            scale.weight_loader = param_loader(layer, per_row)  # type: ignore[attr-defined]
            layer.weight_scale = scale
        else:
            bn, bk = cfg.block
            if input_size % bk:
                raise ValueError(f"fp8 block scales need in_features % {bk} == 0 per rank")
            scale = nn.Parameter(torch.empty(output_size, input_size // bk), requires_grad=False)

            def rows_of_blocks(loaded: torch.Tensor, *shard: Any) -> torch.Tensor:
                rows = checkpoint_rows(layer, *shard)
                return loaded.float().repeat_interleave(bn, dim=0)[:rows]

            scale.weight_loader = param_loader(layer, rows_of_blocks)  # type: ignore[attr-defined]
            layer.weight_scale_inv = scale
        if cfg.has_input_scale:
            layer.input_scale = nn.Parameter(torch.zeros(()), requires_grad=False)
            layer.input_scale.weight_loader = _ignore  # type: ignore[attr-defined]

    def process_after_loading(self, layer: nn.Module) -> None:
        weight = layer_tensor(layer, "weight").data
        name = "weight_scale_inv" if hasattr(layer, "weight_scale_inv") else "weight_scale"
        scale = layer_tensor(layer, name).data.float()
        delattr(layer, name)
        if hasattr(layer, "input_scale"):
            del layer.input_scale
        del layer.weight
        self.finish(layer, weight, scale)

    def finish(self, layer: nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.kernels = use_kernels(weight.device, self.selection.quant_kernels)
        if self.kernels:
            layer.register_buffer("weight_fp8", weight.contiguous(), persistent=False)
            layer.register_buffer("weight_scale", scale.float().contiguous(), persistent=False)
        else:
            dense = fp8_dequantize_ref(weight, scale).to(self.dtype)
            layer.register_buffer("weight_dequant", dense, persistent=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.kernels:
            return F.linear(x, layer_tensor(layer, "weight_dequant"), bias)
        weight, scale = layer_tensor(layer, "weight_fp8"), layer_tensor(layer, "weight_scale")
        sel = self.selection
        return linear_2d(x, lambda x2: fp8_matmul_triton(x2, weight, scale, fp8_gemv=sel.fp8_gemv,
                                                         pdl=sel.pdl), bias)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.kernels:
            return super().apply_gated(layer, x)
        weight, scale = layer_tensor(layer, "weight_fp8"), layer_tensor(layer, "weight_scale")
        sel = self.selection
        return linear_2d(x, lambda x2: fp8_matmul_triton(x2, weight, scale, gated=True,
                                                         fp8_gemv=sel.fp8_gemv, pdl=sel.pdl),
                         None)


class FP8Config(QuantConfig):
    """An fp8 checkpoint: linear layers quantized, the LM head and `ignore`d modules float."""

    name = "fp8"

    def __init__(self, block: tuple[int, int] | None, has_input_scale: bool,
                 ignore: Collection[str] = ()) -> None:
        self.block = block
        self.has_input_scale = has_input_scale
        self.ignore = set(ignore)

    @classmethod
    def from_hf(cls, qcfg: dict[str, Any], tensor_names: Collection[str]) -> FP8Config:
        method = qcfg.get("quant_method")
        has_input = any(n.endswith(".input_scale") for n in tensor_names)
        if method == "fp8":
            block = qcfg.get("weight_block_size")
            ignore = qcfg.get("modules_to_not_convert") or ()
            return cls(tuple(block) if block else None, has_input, ignore)
        groups = list((qcfg.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if not weights or any(w.get("num_bits") != 8 or w.get("type") != "float"
                              for w in weights):
            raise ValueError("compressed-tensors checkpoints are supported for 8-bit float "
                             "weights only")
        strategy = weights[0].get("strategy", "tensor")
        block = weights[0].get("block_structure") if strategy == "block" else None
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"fp8 weight strategy {strategy!r} is not supported")
        return cls(tuple(block) if block else None, has_input, qcfg.get("ignore") or ())

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        skipped = any(prefix == i or prefix.startswith(f"{i}.") or prefix.endswith(f".{i}")
                      for i in self.ignore)
        if not hasattr(layer, "input_size") or skipped:
            return UnquantizedLinearMethod()
        return FP8LinearMethod(self)


__all__ = ["FP8Config", "FP8LinearMethod", "checkpoint_rows", "param_loader"]
