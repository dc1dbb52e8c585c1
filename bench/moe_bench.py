"""Batch-1 decode and 64-request throughput of a gpt-oss-20b-shaped model (random weights, MXFP4
experts kept MXFP4 and run by kernels/mxfp4_moe.py), or of a Qwen3.5-35B-A3B-shaped one
(`--family qwen3_5_moe`: Gated DeltaNet + gated full attention 3:1, 256 experts top-8 + a shared
expert, bf16), with the bandwidth limit measured in the same run.

    python bench/moe_bench.py [--family gpt_oss|qwen3_5_moe] [--layers N] [--experts-bf16]
                              [--out FILE]
    python bench/moe_bench.py --smoke        # same code on CPU at tiny sizes (script check)

Random weights through `load_format="dummy"` in the layout config.json's `quantization_config`
names (MXFP4 blocks / scales for the experts, bf16 elsewhere). Limits: B1 decode tok/s cannot
beat copy bandwidth / bytes one decode step must read (attention, router and the top-4 experts
of every layer, the LM head); the 64-request run reads every expert of every layer per step.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import copy_bandwidth, gpu_state, rand_prompts, run  # noqa: E402
from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402

# openai/gpt-oss-20b's config.json (vocabulary, rope, windows and sizes as published)
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
    "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "sliding_window": 128, "attention_bias": True,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_theta": 150000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096},
    "bos_token_id": 199998, "eos_token_id": 200002,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]},
}
# Qwen/Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults are its sizes)
QWEN3_5_MOE: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "rope_type": "default"},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
    "full_attention_interval": 4,
}
SMOKE = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=1000,
             sliding_window=8)


def model_dir(cfg: dict[str, Any]) -> str:
    d = Path(tempfile.mkdtemp(prefix="gpt-oss-"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def step_bytes(cfg: dict[str, Any], experts_read: int, mxfp4: bool) -> int:
    """Bytes one decode step reads: attention (bf16, with biases), router, `experts_read`
    experts per layer (MXFP4: 4.25 bits a weight, bf16 biases) and the LM head."""
    h, i, v, L = (cfg[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                   "num_hidden_layers"))
    heads = cfg["num_attention_heads"]
    q, kv = heads * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attention = 2 * (h * (q + 2 * kv) + q * h + q + 2 * kv + h + heads)
    router = 2 * (cfg["num_local_experts"] * (h + 1))
    weights = 3 * h * i  # gate, up, down
    expert = (weights * 17 // 32 if mxfp4 else 2 * weights) + 2 * (2 * i + h)
    return L * (attention + router + experts_read * expert + 4 * h) + 2 * v * h


def param_step_bytes(model: torch.nn.Module, experts: int, experts_read: int) -> int:
    """Bytes one decode step reads, from the loaded model: every parameter but the routed
    experts' stacks (tensors whose first dim is the expert count), and `experts_read` / `experts`
    of those (the input embedding's one row is not subtracted: a bound, not an estimate)."""
    dense = routed = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.dim() >= 3 and t.shape[0] == experts:
            routed += t.numel() * t.element_size()
        else:
            dense += t.numel() * t.element_size()
    return dense + routed * experts_read // experts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=("gpt_oss", "qwen3_5_moe"), default="gpt_oss")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's own")
    ap.add_argument("--experts-bf16", action="store_true", help="bf16 experts (A/B)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: a script check")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/moe_bench.json")
    args = ap.parse_args()
    base = GPT_OSS_20B if args.family == "gpt_oss" else QWEN3_5_MOE
    cfg = dict(base, num_hidden_layers=args.layers or base["num_hidden_layers"])
    if args.smoke:
        cfg.update(SMOKE, num_hidden_layers=2)
        if args.family != "gpt_oss":
            cfg.update(num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_hidden_layers=4)
    if args.experts_bf16:
        cfg.pop("quantization_config", None)
    mxfp4 = "quantization_config" in cfg
    n_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    device = "cpu" if args.smoke else "cuda"
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "family": args.family,
                           "layers": cfg["num_hidden_layers"],
                           "experts": "mxfp4" if mxfp4 else "bf16", "torch": torch.__version__}
    if not args.smoke:
        res.update(gpu=torch.cuda.get_device_name(), gpu_state_before=gpu_state(),
                   copy_GBps=copy_bandwidth() / 1e9)
    t = time.perf_counter()
    engine = Engine(EngineConfig(model=model_dir(cfg), load_format="dummy",
                                 dtype="float32" if args.smoke else "bfloat16", device=device,
                                 max_num_seqs=256, max_num_batched_tokens=8192,
                                 num_kv_blocks=256 if args.smoke else None))
    res["startup_s"] = time.perf_counter() - t
    vocab, top_k = cfg["vocab_size"], cfg["num_experts_per_tok"]
    new_tokens = 8 if args.smoke else 256
    run(engine, rand_prompts(2, 64, vocab, 0), 4)  # warm-up
    b1 = run(engine, rand_prompts(1, 128, vocab, 1), new_tokens)
    b64 = run(engine, rand_prompts(64, 128, vocab, 2), new_tokens)
    res["B1"], res["B64"] = b1, b64
    rows = [("B1 batch 1, 128 in", b1["decode_tok_s"], "tok/s decode"),
            ("B64 64 x 128 in", b64["output_tok_s"], "out tok/s")]
    if "copy_GBps" in res:
        bw = res["copy_GBps"] * 1e9
        if args.family == "gpt_oss":
            res["B1_limit_tok_s"] = bw / step_bytes(cfg, top_k, mxfp4)
            # 64 tokens x top-4 of 32 experts: every expert is read each step
            res["B64_limit_tok_s"] = 64 * bw / step_bytes(cfg, n_experts, mxfp4)
        else:
            model = engine.runner.model
            res["B1_limit_tok_s"] = bw / param_step_bytes(model, n_experts, top_k)
            # 64 tokens x top-8 of 256: most experts are read (expected distinct experts)
            read = round(n_experts * (1 - (1 - top_k / n_experts) ** 64))
            res["B64_limit_tok_s"] = 64 * bw / param_step_bytes(model, n_experts, read)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res.get('gpu', 'cpu (smoke)')}  {res['date']}  {args.family}  "
          f"layers {cfg['num_hidden_layers']}  "
          f"experts {res['experts']}  startup {res['startup_s']:.1f}s"
          + (f"  copy {res['copy_GBps']:.0f} GB/s" if "copy_GBps" in res else ""))
    for (name, value, unit), limit in zip(rows, ("B1_limit_tok_s", "B64_limit_tok_s"),
                                          strict=True):
        note = f"{value / res[limit]:.0%} of BW limit {res[limit]:.0f}" if limit in res else ""
        print(f"{name:<22} {value:10.1f} {unit:<14} {note}")


if __name__ == "__main__":
    main()
