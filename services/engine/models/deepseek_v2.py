"""DeepSeek-V2 (and V2-Lite): multi-head latent attention + MoE with shared experts.

- Attention (MLA, layers/mla.py): q through q_a_proj -> q_a_layernorm -> q_b_proj, or one
  q_proj when `q_lora_rank` is null (V2-Lite); kv_a_proj_with_mqa gives the latent (normed by
  kv_a_layernorm) and the shared rope key; only those two are cached. kv_b_proj stays float (its
  weight is used directly, absorbed into the query and the output). The rope part turns in
  interleaved pairs (GPT-J layout) over qk_rope_head_dim dims; YaRN scaling also multiplies the
  softmax scale by mscale(factor, mscale_all_dim)^2.
- MLP: dense for the first `first_k_dense_replace` layers (and off `moe_layer_freq`), else a
  softmax top-k MoE (`topk_method` greedy or group_limited_greedy) with n_shared_experts
  shared experts. With `norm_topk_prob` the weights are renormalised and not scaled (DeepSeek's
  reference code); without, they are scaled by routed_scaling_factor (also transformers').
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from flotilla.services.engine.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    get_rope,
)
from flotilla.services.engine.layers.mla import MLAAttention, yarn_softmax_mscale
from flotilla.services.engine.layers.moe import FusedMoE, RoutingConfig
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from flotilla.services.engine.models.moe_base import (
    MoECausalLM,
    MoEDecoderLayer,
    hf_value,
    shared_mlp,
)
from flotilla.services.engine.quant.base import QuantConfig

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


class DeepseekV2Attention(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_heads
        self.q_lora_rank = hf_value(config, "q_lora_rank")
        self.kv_lora_rank = r = int(hf_value(config, "kv_lora_rank"))
        self.nope_dim = int(hf_value(config, "qk_nope_head_dim"))
        self.rope_dim = int(hf_value(config, "qk_rope_head_dim"))
        v_dim = int(hf_value(config, "v_head_dim"))
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(hf_value(config, "attention_bias", default=False))
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, quant_config,
                                             f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, False,
                                                 quant_config, f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, False, quant_config,
                                               f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, r + self.rope_dim, bias, quant_config,
                                                   f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(r, MLA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(r, heads * (self.nope_dim + v_dim), False, None,
                                              f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(heads * v_dim, hidden, bias, quant_config,
                                        f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.rope_dim, self.rope_dim, config.max_position_embeddings,
                                   config.rope_theta, config.rope_scaling,
                                   is_neox=not self.rope_interleaved(config))
        scale = qk_dim**-0.5 * yarn_softmax_mscale(config.rope_scaling)
        self.num_heads = self.kv_b_proj.output_size // (self.nope_dim + v_dim)
        self.attn = MLAAttention(self.num_heads, self.nope_dim, self.rope_dim, v_dim, r, scale)

    @staticmethod
    def rope_interleaved(config: ModelConfig) -> bool:
        return True

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim],
                                                              -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.reshape(t, 1, -1),
                                     self.attn.selection)
        out = self.attn(q_nope, q_pe, latent, k_pe.reshape(t, -1), self.kv_b_proj.weight)
        return self.o_proj(out)


class DeepseekV2DecoderLayer(MoEDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = DeepseekV2Attention  # type: ignore[assignment]

    @staticmethod
    def routing(config: ModelConfig) -> RoutingConfig:
        grouped = hf_value(config, "topk_method", default="greedy") == "group_limited_greedy"
        renormalize = bool(hf_value(config, "norm_topk_prob", default=False))
        return RoutingConfig(
            num_experts=int(hf_value(config, "n_routed_experts")),
            top_k=int(hf_value(config, "num_experts_per_tok")),
            renormalize=renormalize,
            n_group=hf_value(config, "n_group") if grouped else None,
            topk_group=hf_value(config, "topk_group") if grouped else None,
            routed_scaling_factor=(1.0 if renormalize else
                                   float(hf_value(config, "routed_scaling_factor", default=1.0))),
            router_fp32=True,
        )

    def make_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> nn.Module:
        first_moe = int(hf_value(config, "first_k_dense_replace", default=0))
        freq = int(hf_value(config, "moe_layer_freq", default=1))
        if not hf_value(config, "n_routed_experts") or layer < first_moe or layer % freq:
            return LlamaMLP(config, quant_config, prefix)
        inter = int(hf_value(config, "moe_intermediate_size"))
        n_shared = int(hf_value(config, "n_shared_experts", default=0))
        shared = (shared_mlp(config, inter * n_shared, quant_config, f"{prefix}.shared_experts")
                  if n_shared else None)
        return FusedMoE(config.hidden_size, inter, self.routing(config), shared,
                        "shared_experts", hidden_act=config.hidden_act,
                        quant_config=quant_config, prefix=prefix)


class DeepseekV2ForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = DeepseekV2DecoderLayer
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),  # dense layers and shared experts
        "up_proj": ("gate_up_proj", 1),
    }
