"""StableLM (stablelm-2, stablelm-3b-4e1t, stable-code): llama with LayerNorm (with bias) norms,
partial rotary (`partial_rotary_factor`, 25% of each head), optional q/k/v bias
(`use_qkv_bias`), optional per-head LayerNorm on q and k (`qk_layernorm`, stablelm-2-12b) and
optional parallel attention + MLP residual (`use_parallel_residual`, stablelm-2-12b)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.services.engine.distributed import get_tp_rank
from flotilla.services.engine.layers import LayerNorm
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from flotilla.services.engine.quant.base import QuantConfig


class PerHeadLayerNorm(nn.Module):
    """One bias-free LayerNorm per head (checkpoint `norms.{h}.weight`, all heads on every rank);
    x [T, H_local, D] uses heads first_head .. first_head + H_local."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, first_head: int) -> None:
        super().__init__()
        self.eps, self.first_head = eps, first_head
        self.layer_norms = [LayerNorm(head_dim, eps, bias=False) for _ in range(num_heads)]
        self.norms = nn.ModuleList(self.layer_norms)  # registered (checkpoint: norms.{h}.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.layer_norms[self.first_head : self.first_head + x.shape[1]]
        weight = torch.stack([norm.weight for norm in heads])  # [H_local, D]
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * weight


class StableLmAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__(config, quant_config, prefix, layer)
        self.qk_layernorm = bool(config.hf_config.get("qk_layernorm"))
        if self.qk_layernorm:
            rank, d, eps = get_tp_rank(), config.head_dim, config.rms_norm_eps
            self.q_layernorm = PerHeadLayerNorm(config.num_heads, d, eps, rank * self.num_heads)
            kv_rank = rank // self.qkv_proj.kv_replicas
            self.k_layernorm = PerHeadLayerNorm(config.num_kv_heads, d, eps,
                                                kv_rank * self.num_kv_heads)

    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return bool(config.hf_config.get("use_qkv_bias")), False

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.qk_layernorm:
            return q, k
        return self.q_layernorm(q), self.k_layernorm(k)


class StableLmDecoderLayer(LlamaDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = StableLmAttention
    norm_cls: ClassVar[type[nn.Module]] = LayerNorm


class StableLmParallelDecoderLayer(StableLmDecoderLayer):
    """x + attn(ln(x)) + mlp(ln(x)): one norm, attention and MLP side by side."""

    norm_names: ClassVar[tuple[str | None, ...]] = ("input_layernorm", None, None, None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            hidden = hidden + residual
        norm = self.norms["pre_attn"]
        assert norm is not None
        normed = norm(hidden)
        return self.self_attn(positions, normed) + self.mlp(normed), hidden


class StableLmForCausalLM(LlamaForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = StableLmDecoderLayer

    @classmethod
    def decoder_layer_cls(cls, config: ModelConfig) -> type[LlamaDecoderLayer]:
        if config.hf_config.get("use_parallel_residual"):
            return StableLmParallelDecoderLayer
        return cls.layer_cls
