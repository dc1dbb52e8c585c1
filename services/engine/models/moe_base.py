"""What the mixture-of-experts families add to the llama skeleton (models/llama.py).

Rules:
- `MoEDecoderLayer` is a LlamaDecoderLayer whose `mlp` is built per layer by
  `make_mlp(config, quant_config, prefix, layer)`: families mix dense and MoE layers (deepseek's
  first_k_dense_replace, qwen's mlp_only_layers / decoder_sparse_step).
- `MoECausalLM` puts the expert entries (`expert_mapping`, they depend on the expert count) in
  this instance's packed_modules_mapping, ahead of the class-level q/k/v and gate/up keys that
  would otherwise also match `experts.{e}.gate_proj`. It skips checkpoint tensors of layers past
  num_hidden_layers (deepseek_v3's multi-token-prediction layer, unused for generation).
- `shared_mlp` is a dense gated MLP of another width (shared experts).
- Checkpoints that stack their experts (gpt-oss, llama4: `experts.gate_up_proj` [E, H, 2I] and
  `experts.down_proj` [E, I, H] in x @ W layout, gpt-oss's biases and MXFP4 blocks / scales
  [E, out, ...]) are split per expert into the names the stacks load; `stacked_gate_up` says
  how gate and up share the 2I outputs: "interleaved" (gate even, up odd: gpt-oss) or "halves"
  (gate first: llama4).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from flotilla.services.engine.layers.moe import expert_weights_mapping
from flotilla.services.engine.layers.moe_offload import in_layer
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from flotilla.services.engine.quant.base import QuantConfig

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def hf_value(config: ModelConfig, *keys: str, default: Any = None) -> Any:
    """The first of `keys` present (and not None) in the HF config."""
    for key in keys:
        if config.hf_config.get(key) is not None:
            return config.hf_config[key]
    return default


def shared_mlp(config: ModelConfig, intermediate_size: int, quant_config: QuantConfig | None,
               prefix: str) -> LlamaMLP:
    return LlamaMLP(dataclasses.replace(config, intermediate_size=intermediate_size),
                    quant_config, prefix)


class _LateMLP(nn.Module):
    """Fills LlamaDecoderLayer's mlp slot until MoEDecoderLayer builds the real one."""

    def __init__(self, *args: object) -> None:
        super().__init__()


class MoEDecoderLayer(LlamaDecoderLayer):
    mlp_cls: ClassVar[type[nn.Module]] = _LateMLP

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__(config, quant_config, prefix, layer)
        with in_layer(layer):  # expert offload places experts by decoder layer
            self.mlp = self.make_mlp(config, quant_config, f"{prefix}.mlp", layer)

    def make_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> nn.Module:
        raise NotImplementedError


# suffixes of stacked expert tensors (float, or MXFP4 blocks and scales)
STACKED_EXPERTS = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
                   "experts.down_proj_bias", "experts.gate_up_proj_blocks",
                   "experts.gate_up_proj_scales", "experts.down_proj_blocks",
                   "experts.down_proj_scales")


def split_stacked_experts(prefix: str, stacked: str, tensor: torch.Tensor, interleaved: bool
                          ) -> Iterable[tuple[str, torch.Tensor]]:
    """`{prefix}.{e}.{gate,up,down}_proj.{weight,bias,blocks,scales}` of a stacked expert
    tensor. Float weights are [in, out] (x @ W); MXFP4 blocks [out, in / 32, 16] and scales
    [out, in / 32] are nn.Linear-major."""
    proj, _, kind = stacked.removeprefix("experts.").partition("_proj")
    kind = kind.removeprefix("_") or "weight"
    for e, t in enumerate(tensor):
        if kind == "weight":
            t = t.t()  # [out, in]
        elif kind == "blocks":
            t = t.flatten(-2)  # [out, in / 2]
        if proj == "down":
            yield f"{prefix}.{e}.down_proj.{kind}", t
        elif interleaved:
            yield f"{prefix}.{e}.gate_proj.{kind}", t[0::2]
            yield f"{prefix}.{e}.up_proj.{kind}", t[1::2]
        else:
            half = t.shape[0] // 2
            yield f"{prefix}.{e}.gate_proj.{kind}", t[:half]
            yield f"{prefix}.{e}.up_proj.{kind}", t[half:]


class MoECausalLM(LlamaForCausalLM):
    # how stacked checkpoint experts hold gate and up (None: stored per expert)
    stacked_gate_up: ClassVar[str | None] = None

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(config, quant_config)
        # Per instance: the keys depend on the expert count of this checkpoint.
        self.packed_modules_mapping = {  # type: ignore[misc]
            **self.expert_mapping(config), **type(self).packed_modules_mapping}

    def expert_mapping(self, config: ModelConfig) -> dict[str, tuple[str, str | int]]:
        return expert_weights_mapping(int(hf_value(config, "num_experts", "num_local_experts",
                                                   "n_routed_experts", default=0)))

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        stacked = next((s for s in STACKED_EXPERTS if name.endswith(f".{s}")), None)
        if stacked is None or self.stacked_gate_up is None:
            return super().checkpoint_tensors(name, tensor)
        prefix = name.removesuffix(stacked.removeprefix("experts.")).rstrip(".")
        return split_stacked_experts(prefix, stacked, tensor,
                                     self.stacked_gate_up == "interleaved")

    def skip_weight(self, name: str) -> bool:
        match = _LAYER_RE.match(name)
        if match is not None and int(match.group(1)) >= self.config.num_layers:
            return True
        return super().skip_weight(name)
