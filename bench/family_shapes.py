"""Real-size transformers configs, one per supported family, for bench/family_parity.py.

Each family keeps its model's hidden sizes, head layout, rope and routing, with the reductions
that keep a device run short, stated per family in `note` and for all in `REDUCTIONS`:
2 layers (3 where sliding and global layers alternate, so both kinds run), a 32,000-token
vocabulary, fewer routed experts (top-k and expert sizes kept), and sliding windows of 32 so a
64-token prompt is really cut. `shrink` maps a config onto the tiny sizes of the CPU parity tests
(tests/engine/test_architectures.py TINY, tests/engine/test_moe_models.py MLA) for --smoke.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from bench.engine_bench import LLAMA3_8B
from tests.engine.test_architectures import TINY, Case, _yarn
from tests.engine.test_moe_models import MLA

WINDOW = 32
REDUCTIONS = ("2 layers (3 for gemma2/gemma3, 4 for smollm3/llama4; hybrids one linear-attention "
              "and one full-attention layer), vocab 32000, routed "
              "experts reduced (top-k and "
              f"expert sizes real), sliding windows {WINDOW} (prompt 64 tokens), random weights "
              "(std 0.02, norm scales and biases perturbed)")


class Family(NamedTuple):
    case: Case  # model_type, real-size overrides, transformers class
    note: str  # the model whose sizes these are, and what was reduced


COMMON: dict[str, Any] = dict(vocab_size=32000, num_hidden_layers=2, initializer_range=0.02,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              tie_word_embeddings=False)
_LLAMA3 = {k: v for k, v in LLAMA3_8B.items()
           if k not in ("architectures", "model_type", "torch_dtype", "vocab_size",
                        "num_hidden_layers", "bos_token_id", "eos_token_id")}
_GEMMA = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW,
              num_hidden_layers=3, tie_word_embeddings=True, rms_norm_eps=1e-6,
              hidden_activation="gelu_pytorch_tanh")
_QWEN = dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6)
_DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0,
                      beta_slow=1.0, original_max_position_embeddings=4096)
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            rms_norm_eps=1e-6, max_position_embeddings=163840)
# Ministral 3 8B's text model (Mistral3ForConditionalGeneration); a tiny vision tower beside it.
_MINISTRAL3_TEXT = dict(
    COMMON, model_type="ministral3", hidden_size=4096, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
    max_position_embeddings=262144, rope_parameters=_yarn(
        mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1,
        original_max_position_embeddings=16384))
# Hybrid linear attention (Gated DeltaNet): Qwen3-Next-80B-A3B / Qwen3.5 sizes, one
# linear-attention layer then one gated full-attention layer.
_HYBRID = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=262144, layer_types=["linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25})
_TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, image_size=32, patch_size=16, head_dim=8)

FAMILIES: dict[str, Family] = {
    "llama": Family(Case("llama", dict(_LLAMA3, max_position_embeddings=131072)),
                    "Llama-3.1-8B, llama3 rope"),
    "mistral": Family(Case("mistral", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, sliding_window=WINDOW,
        max_position_embeddings=32768)), "Mistral-7B-v0.1, window 4096->32"),
    "ministral": Family(Case("ministral", dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 100000000.0},
        max_position_embeddings=32768)), "Ministral-8B-2410, window 32768->32"),
    "mistral3": Family(Case("mistral3", dict(
        text_config=_MINISTRAL3_TEXT, vision_config=_TINY_VISION, tie_word_embeddings=False),
        "Mistral3ForConditionalGeneration"), "Ministral-3-8B text, YaRN, tiny vision"),
    "phi3": Family(Case("phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=32, rms_norm_eps=1e-5, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": 4096})), "Phi-3-mini-128k, LongRoPE short"),
    "qwen2": Family(Case("qwen2", dict(
        _QWEN, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768)), "Qwen2.5-7B, qkv bias"),
    "qwen3": Family(Case("qwen3", dict(
        _QWEN, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)),
        "Qwen3-8B, q/k norm"),
    "qwen2_moe": Family(Case("qwen2_moe", dict(
        _QWEN, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
        num_key_value_heads=4, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
        num_experts=16, num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=32768)),
        "Qwen2-57B-A14B, 64->16 experts top-8"),
    "qwen3_moe": Family(Case("qwen3_moe", dict(
        _QWEN, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=32,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960)),
        "Qwen3-30B-A3B, 128->32 experts top-8"),
    "mixtral": Family(Case("mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=32768)), "Mixtral-8x7B, 8->4 experts top-2"),
    # Caps 2 and 3 instead of 50 and 30: at random init scores and logits stay far below 50 / 30,
    # where tanh capping is the identity to bf16 precision and would go untested.
    "gemma2": Family(Case("gemma2", dict(
        _GEMMA, hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
        num_key_value_heads=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        max_position_embeddings=8192)), "gemma-2-9b, window 4096->32, caps 50/30->2/3"),
    "gemma3": Family(Case("gemma3_text", dict(
        _GEMMA, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=131072,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}})),
        "gemma-3-12b text, window 1024->32"),
    "stablelm": Family(Case("stablelm", dict(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
        num_key_value_heads=32, partial_rotary_factor=0.25, use_qkv_bias=True,
        layer_norm_eps=1e-5, max_position_embeddings=4096)), "stablelm-2-1.6b, 25% rotary"),
    "glm4": Family(Case("glm4", dict(
        hidden_size=4096, intermediate_size=13696, num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5, attention_bias=True,
        rms_norm_eps=1e-5, max_position_embeddings=32768)), "GLM-4-9B-0414"),
    "deepseek_v2": Family(Case("deepseek_v2", dict(
        _MLA, hidden_size=2048, intermediate_size=10944, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, moe_intermediate_size=1408,
        n_routed_experts=16, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=False, rope_parameters=dict(_DEEPSEEK_YARN, mscale=0.707,
                                                   mscale_all_dim=0.707))),
        "DeepSeek-V2-Lite, 64->16 experts top-6"),
    "deepseek_v3": Family(Case("deepseek_v3", dict(
        _MLA, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, moe_intermediate_size=2048,
        n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(_DEEPSEEK_YARN, mscale=1.0, mscale_all_dim=1.0))),
        "DeepSeek-V3, 256->32 experts top-8, 1 dense + 1 MoE layer"),
    "smollm3": Family(Case("smollm3", dict(
        hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
        num_key_value_heads=4, num_hidden_layers=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
        max_position_embeddings=65536)), "SmolLM3-3B, 4 layers (the 4th NoPE)"),
    "glm4_moe": Family(Case("glm4_moe", dict(
        hidden_size=4096, intermediate_size=10944, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408, n_routed_experts=32,
        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "partial_rotary_factor": 0.5})),
        "GLM-4.5-Air, 128->32 experts top-8, 1 dense + 1 MoE layer"),
    # bf16 experts (transformers' reference has no MXFP4 path without a GPU kernel package)
    "gpt_oss": Family(Case("gpt_oss", dict(
        hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=WINDOW, rms_norm_eps=1e-5, max_position_embeddings=131072)),
        "gpt-oss-20b (bf16 experts), window 128->32, 1 sliding + 1 full layer"),
    "llama4": Family(Case("llama4_text", dict(
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=1, num_hidden_layers=4,
        attention_chunk_size=WINDOW, rms_norm_eps=1e-5, max_position_embeddings=262144,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192})),
        "Llama-4-Scout text, 16->4 experts top-1, 4 layers (3 chunked, 1 NoPE), chunk "
        "8192->32"),
    "qwen3_next": Family(Case("qwen3_next", dict(
        _HYBRID, intermediate_size=5120, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=32, num_experts_per_tok=10,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
        "Qwen3-Next-80B-A3B, 512->32 experts top-10, 1 linear + 1 full layer"),
    "qwen3_5": Family(Case("qwen3_5_text", dict(
        _HYBRID, hidden_size=4096, intermediate_size=12288, num_key_value_heads=4)),
        "Qwen3.5-9B text, 1 linear + 1 full layer"),
    "qwen3_5_moe": Family(Case("qwen3_5_moe_text", dict(
        _HYBRID, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=32, num_experts_per_tok=8)),
        "Qwen3.5-35B-A3B text, 256->32 experts top-8, 1 linear + 1 full layer"),
    "minimax_m2": Family(Case("minimax_m2", dict(
        hidden_size=3072, intermediate_size=1536, num_attention_heads=48, num_key_value_heads=8,
        head_dim=128, num_local_experts=32, num_experts_per_tok=8, rms_norm_eps=1e-6,
        max_position_embeddings=196608,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                         "partial_rotary_factor": 0.5})),
        "MiniMax-M2, 256->32 experts top-8"),
    # 64-token prompts are far below index_topk (2048): the indexer keeps every key, so
    # transformers' sparse attention is the dense one the engine runs
    "deepseek_v32": Family(Case("deepseek_v32", dict(
        _MLA, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, moe_intermediate_size=2048,
        n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        index_topk=2048, index_n_heads=64, index_head_dim=128,
        rope_parameters=dict(_DEEPSEEK_YARN, mscale=1.0, mscale_all_dim=1.0))),
        "DeepSeek-V3.2 (dense fallback), 256->32 experts top-8, 1 dense + 1 MoE layer"),
}

# --smoke: each size onto the CPU tests' tiny value; routing, rope kinds and flags stay.
_TINY_SIZES: dict[str, Any] = dict(
    {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                          "num_attention_heads", "initializer_range")},
    head_dim=16, query_pre_attn_scalar=16, shared_expert_intermediate_size=48,
    intermediate_size_mlp=TINY["intermediate_size"], linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
    **{k: MLA[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                           "moe_intermediate_size")})


def shrink(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same config at the CPU tests' tiny sizes (nested text_config included)."""
    out = {k: (_TINY_SIZES[k] if k in _TINY_SIZES else v) for k, v in cfg.items()}
    if "num_key_value_heads" in cfg:  # keep MHA as MHA, GQA as GQA
        mha = cfg["num_key_value_heads"] == cfg["num_attention_heads"]
        out["num_key_value_heads"] = TINY["num_attention_heads"] if mha else 2
    if cfg.get("q_lora_rank"):
        out["q_lora_rank"] = 24
    if isinstance(cfg.get("text_config"), dict):
        out["text_config"] = shrink(cfg["text_config"])
    return out


def config_dict(family: Family, smoke: bool) -> dict[str, Any]:
    """The keyword arguments of the family's transformers config class."""
    if "text_config" in family.case.overrides:
        cfg = dict(family.case.overrides)
    else:
        cfg = {**COMMON, **family.case.overrides}
    cfg = shrink(cfg) if smoke else cfg
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type") == "longrope":
        cfg["rope_parameters"] = {**rope, **_longrope_factors(cfg)}
    return cfg


def _longrope_factors(cfg: dict[str, Any]) -> dict[str, list[float]]:
    """One factor per rotary frequency (Phi-3-128k's grow from 1 to ~50 / ~1 to ~1.3 alike)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n = int(head_dim * cfg.get("partial_rotary_factor", 1.0)) // 2
    return {"short_factor": [1.0 + 0.3 * i / n for i in range(n)],
            "long_factor": [1.0 + 50.0 * (i / n) ** 2 for i in range(n)]}
