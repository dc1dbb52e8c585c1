"""GGUF tensor names -> HF checkpoint names, per `general.architecture`.

llama.cpp's converter renames every tensor (blk.N.attn_q.weight, ...). Most architectures share
the llama map; an architecture whose converter gives a GGUF name another meaning overrides it
(phi3 fuses q/k/v into attn_qkv and gate/up into ffn_up). Only the llama family (llama,
mistral, smollm3) has its q/k rows permuted by the converter (interleaved rotary pairs), which
the loader undoes. Gemma 2 / 3 name their four norms per layer their own way (their 1 + w norm
values and hard-coded hyper-parameters: gguf_gemma.py).

Mixture-of-experts GGUFs store each layer's experts stacked in one [E, out, in] tensor
(`ffn_{gate,up,down}_exps`); their HF name holds an `{e}` (EXPERT) that the loader fills in with
each expert's index. The router is `ffn_gate_inp`, qwen2moe's shared expert `ffn_*_shexp` with
its sigmoid gate `ffn_gate_inp_shexp`. Mixtral converts to arch "llama" (with an expert count)
under its own HF names (block_sparse_moe, experts w1 / w3 / w2).

deepseek2 (DeepSeek-V2 / V3, gguf_deepseek2.py) names its MLA projections and plural
shared_experts; both halves of its split kv_b_proj (KV_B_PARTS) map to kv_b_proj, which the
loader joins. An entry keyed "part.kind" names the whole HF suffix (V3's router correction bias
is a buffer, `e_score_correction_bias`, not a `.bias`). glm4moe names deepseek's shared experts
and correction bias the same way, and its second norm `post_attention_norm`; its MTP layers'
`nextn.*` tensors are not mapped. minimax-m2 keeps Mixtral's HF names (block_sparse_moe, w1 /
w3 / w2) and stores its correction bias as `exp_probs_b.bias`. gpt-oss names its sinks
`attn_sinks` and its biased router `ffn_gate_inp`; its expert biases are stacked like the
weights (`ffn_*_exps.bias`).
The hybrid archs (qwen3next, qwen35, qwen35moe: gguf_qwen3next.py) name the Gated DeltaNet's
tensors `attn_qkv` / `attn_gate` / `ssm_*` (qwen3next's fused `ssm_ba`, qwen35's `ssm_alpha` /
`ssm_beta`); `ssm_a` has no `.weight` suffix.
"""

from __future__ import annotations

import re

# Architectures whose llama.cpp converter applies the q/k row permutation.
PERMUTED_ARCHS = frozenset({"llama", "mistral", "smollm3"})
EXPERT = "{e}"  # stands for the expert index in the HF names of stacked expert tensors

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # qwen2moe / qwen3moe router
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "llama": {  # Mixtral
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": f"block_sparse_moe.experts.{EXPERT}.w1",
        "ffn_up_exps": f"block_sparse_moe.experts.{EXPERT}.w3",
        "ffn_down_exps": f"block_sparse_moe.experts.{EXPERT}.w2",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "deepseek2": {
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",  # converters before the k_b / v_b split
        "attn_k_b": "self_attn.kv_b_proj",
        "attn_v_b": "self_attn.kv_b_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
    "glm4moe": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
    **{arch: {
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_ba": "linear_attn.in_proj_ba",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_conv1d": "linear_attn.conv1d",
        "ssm_dt.bias": "linear_attn.dt_bias",
        "ssm_norm": "linear_attn.norm",
        "ssm_out": "linear_attn.out_proj",
        "post_attention_norm": "post_attention_layernorm",
    } for arch in ("qwen3next", "qwen35", "qwen35moe")},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    "minimax-m2": {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": f"block_sparse_moe.experts.{EXPERT}.w1",
        "ffn_up_exps": f"block_sparse_moe.experts.{EXPERT}.w3",
        "ffn_down_exps": f"block_sparse_moe.experts.{EXPERT}.w2",
        "exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias",
    },
    "gpt-oss": {
        "attn_sinks.weight": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
    },
}
# GGUF block tensors that are the (k, v) halves of one HF kv_b_proj (deepseek2).
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")
# Architectures with a verified map (the loader refuses others rather than guess).
MAPPED_ARCHS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "qwen2moe", "qwen3moe",
                         "deepseek2", "smollm3", "glm4moe", "gpt-oss", "llama4", "gemma2",
                         "gemma3", "qwen3next", "qwen35", "qwen35moe", "minimax-m2"})
# block tensors stored without a .weight / .bias suffix -> HF suffix
BARE_BLOCK_NAMES = {"ssm_a": "linear_attn.A_log"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_BARE_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF checkpoint name of a GGUF tensor, or None for tensors the model does not load. Stacked
    expert tensors get a name holding EXPERT."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None:
        bare = _BARE_RE.match(gguf_name)
        if bare is not None and bare.group(2) in BARE_BLOCK_NAMES:
            return f"model.layers.{bare.group(1)}.{BARE_BLOCK_NAMES[bare.group(2)]}"
        return None
    layer, part, kind = match.groups()
    arch_names = ARCH_BLOCK_NAMES.get(arch, {})
    if f"{part}.{kind}" in arch_names:
        return f"model.layers.{layer}.{arch_names[f'{part}.{kind}']}"
    name = arch_names.get(part) or BLOCK_NAMES.get(part)
    return None if name is None else f"model.layers.{layer}.{name}.{kind}"
