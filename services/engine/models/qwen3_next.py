"""Qwen3-Next: hybrid decoder, Gated DeltaNet linear attention (layers/gated_delta_net.py) on
most layers and gated full attention on every `full_attention_interval`-th (the config's
`layer_types`), each followed by qwen2_moe's MoE (softmax top-k, a shared expert behind a
sigmoid gate) or, off the `decoder_sparse_step` rhythm / in `mlp_only_layers`, a dense MLP.

- Gated attention: q_proj gives each head its query and an output gate ([q_h, gate_h] per head
  in the checkpoint); the attention output is multiplied by sigmoid(gate) before o_proj. q/k
  per-head norms, rotary on `partial_rotary_factor` of each head (neox).
- Every RMSNorm (decoder norms, q/k norms) scales by (1 + w) as gemma's, with 1 + w kept in
  fp32 and applied before the one rounding, as transformers computes it (`ZeroCenteredRMSNorm`:
  in bf16, 1 + w would round to steps of 2^-7, a 0.4% per-channel error); the DeltaNet's gated
  output norm scales by w.
- The linear-attention layers keep a per-sequence state in the state pool
  (services/engine/state_pool.py); only the full-attention layers take KV blocks.
- Checkpoint tensors of the multi-token-prediction head (`mtp.*`) are skipped.
Qwen3.5 and Qwen3.5-MoE are this model too: their checkpoints store the DeltaNet projections
unfused (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; split_checkpoint_tensor reads both
layouts), Qwen3.5 has dense MLPs only, and Qwen3.5-MoE's experts may come stacked
(`experts.gate_up_proj` [E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I]).
Their vision-language checkpoints serve the text model (models/qwen3_5.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from flotilla.services.engine.layers import GemmaRMSNorm, QKVParallelLinear
from flotilla.services.engine.layers.gated_delta_net import (
    GDN_PACKED,
    GatedDeltaNet,
    GatedDeltaNetDims,
    split_checkpoint_tensor,
)
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.moe_base import MoECausalLM
from flotilla.services.engine.models.qwen2_moe import Qwen2MoeDecoderLayer
from flotilla.services.engine.quant.base import QuantConfig

LINEAR_ATTENTION = "linear_attention"


class ZeroCenteredRMSNorm(GemmaRMSNorm):
    """GemmaRMSNorm whose stored scale 1 + w stays fp32 whatever the model dtype, applied to the
    fp32 normalised row and rounded once, transformers' `(x_normed * (1 + w)).type_as(x)` (the
    llama order's extra rounding of x_normed made a 1.4x larger bf16 error here)."""

    round_normed: ClassVar[bool] = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]


class Qwen3NextAttention(LlamaAttention):
    qk_norm_cls: ClassVar[type[nn.Module] | None] = ZeroCenteredRMSNorm

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__(config, quant_config, prefix, layer)
        # q_proj holds twice the heads: per head its query, then its output gate
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          2 * config.num_heads, config.num_kv_heads,
                                          config.attention_bias, quant_config,
                                          f"{prefix}.qkv_proj")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size],
                                               dim=-1)
        q, gate = qg.reshape(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        q, k = self.norm_qk(q.contiguous(), k.reshape(t, self.num_kv_heads, d))
        if self.fused_rotary:
            out = self.attn(q, k, v, self.rotary_emb, positions)
        else:
            q, k = self.rotate(positions, q, k)
            out = self.attn(q, k, v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, self.q_size)))


class Qwen3NextDecoderLayer(Qwen2MoeDecoderLayer):
    """A linear-attention layer (`linear_attn`) or a gated full-attention one (`self_attn`),
    then the MLP of qwen2_moe's rules (MoE or dense)."""

    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3NextAttention
    norm_cls: ClassVar[type[nn.Module]] = ZeroCenteredRMSNorm

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        nn.Module.__init__(self)
        if config.layer_types is None:
            raise ValueError("a hybrid model's config needs layer_types")
        self.mixer: nn.Module
        if config.layer_types[layer] == LINEAR_ATTENTION:
            self.linear_attn = self.mixer = GatedDeltaNet(config, quant_config,
                                                          f"{prefix}.linear_attn")
            self.is_linear = True
        else:
            self.self_attn = self.mixer = self.attention_cls(config, quant_config,
                                                             f"{prefix}.self_attn", layer)
            self.is_linear = False
        self.mlp = self.make_mlp(config, quant_config, f"{prefix}.mlp", layer)
        self.input_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mixer(hidden) if self.is_linear else self.mixer(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen3NextDecoderLayer

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(config, quant_config)
        self.packed_modules_mapping = {**GDN_PACKED, **self.packed_modules_mapping}  # type: ignore[misc]
        self.gdn_dims = GatedDeltaNetDims(config)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and tensor.dim() == 3:
            yield from _split_stacked(name, tensor)
            return
        for part, t in split_checkpoint_tensor(name, tensor, self.gdn_dims):
            yield from super().checkpoint_tensors(part, t)

    def skip_weight(self, name: str) -> bool:
        return name.startswith("mtp.") or super().skip_weight(name)


def _split_stacked(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """Stacked experts in nn.Linear layout ([E, out, in]) as per-expert weights."""
    prefix, _, proj = name.rpartition(".")
    for e, t in enumerate(tensor):
        if proj == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", t
        else:
            half = t.shape[0] // 2
            yield f"{prefix}.{e}.gate_proj.weight", t[:half]
            yield f"{prefix}.{e}.up_proj.weight", t[half:]
