"""The interface every causal LM exposes to the loader and the ModelRunner.

Rules:
- `forward(input_ids [T], positions [T]) -> hidden [T, H]` runs inside `forward_context(meta)`;
  it returns final-normed hidden states for every new token, not logits.
- `compute_logits(hidden [N, H]) -> float32 [N, vocab]`: the runner passes only the rows it
  samples from (last token of each sequence), so the LM head never runs on prefill rows.
- `attention_layers()` lists the `Attention` modules in layer order; the runner binds one KV cache
  pair to each. `state_layers()` lists the linear-attention modules (hybrid models), to which the
  runner binds their per-sequence state (services/engine/state_pool.py); only the attention
  layers take KV blocks.
- Constructor: `(config: ModelConfig, quant_config: QuantConfig | None)`; layers read the
  tensor-parallel rank/size at construction, so `init_tensor_parallel` comes first.
- Weight loading is declarative: `packed_modules_mapping` maps a checkpoint sub-name onto a fused
  parameter and its shard id (q_proj -> qkv_proj/"q"); `checkpoint_name(name)` renames first,
  `checkpoint_tensors(name, tensor)` may then turn one checkpoint tensor into several in the
  model's naming (a stacked [E, ...] expert tensor into per-expert ones);
  `skip_weight(name)` drops checkpoint tensors the model does not use (e.g. a tied lm_head saved
  anyway, a vision tower).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from flotilla.services.engine.layers.attention import Attention
from flotilla.services.engine.layers.gated_delta_net import GatedDeltaNet
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.quant.base import QuantConfig


class CausalLM(nn.Module):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self._attention_layers: list[Attention] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention_layers(self) -> list[Attention]:
        if self._attention_layers is None:
            self._attention_layers = [m for m in self.modules() if isinstance(m, Attention)]
        return self._attention_layers

    def state_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this model's naming (identity; multimodal checkpoints
        served text-only strip their language-model prefix here)."""
        return name

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs one renamed checkpoint tensor loads as (itself here)."""
        return ((name, tensor),)

    def skip_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        return self.config.tie_word_embeddings and name.startswith("lm_head.")
