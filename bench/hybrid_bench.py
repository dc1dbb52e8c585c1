"""Batch-1 decode and 64-request throughput of a Qwen3.5-35B-A3B-shaped hybrid model (Gated
DeltaNet linear attention on 3 of 4 layers, gated full attention on the 4th, 256 experts top-8
plus a shared expert; random bf16 weights), with the bandwidth limit measured in the same run.

    python bench/hybrid_bench.py [--layers N] [--out FILE]
    python bench/hybrid_bench.py --smoke     # same code on CPU at tiny sizes (script check)

Random weights through `load_format="dummy"`. The full model is 35B parameters (70 GB in bf16):
by default 16 of its 40 layers run (stated in the output), the layer pattern kept. Limits: B1
decode tok/s cannot beat copy bandwidth / bytes one decode step must move: every layer's
non-expert weights, the top-8 and the shared expert, the LM head, and each linear-attention
layer's recurrent state read and written (fp32 [32, 128, 128], 2 MiB a layer per sequence);
in the 64-request run every expert of every layer is read once per step and every sequence's
state moves. Prints a table and writes JSON.
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
from services.engine.engine import Engine, EngineConfig  # noqa: E402

# Qwen/Qwen3.5-35B-A3B's text config (sizes, pattern, rope as published)
QWEN3_5_35B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 248044,
    "eos_token_id": 248046,
}
SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=1000)


def with_layers(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config cut to `layers` layers, every 4th full attention as published."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return dict(cfg, num_hidden_layers=layers, layer_types=types)


def step_bytes(cfg: dict[str, Any], experts_read: int, seqs: int) -> int:
    """Bytes one decode step of `seqs` sequences moves (bf16 weights, fp32 states)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    kd, vd = hk * dk, hv * dv
    conv = 2 * kd + vd
    linear = 2 * (h * (conv + vd + 2 * hv) + vd * h + conv * cfg["linear_conv_kernel_dim"])
    state = seqs * (2 * hv * dk * dv * 4 + 2 * conv * 3 * 2)  # read + write
    heads, d = cfg["num_attention_heads"], cfg["head_dim"]
    full = 2 * (h * (2 * heads * d + 2 * cfg["num_key_value_heads"] * d) + heads * d * h)
    expert = 2 * 3 * h * cfg["moe_intermediate_size"]
    shared = 2 * 3 * h * cfg["shared_expert_intermediate_size"] + 2 * h
    mlp = 2 * cfg["num_experts"] * h + experts_read * expert + shared
    total = 2 * v * h
    for kind in cfg["layer_types"]:
        total += mlp + 4 * h + (linear + state if kind == "linear_attention" else full)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: a script check")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/hybrid_bench.json")
    args = ap.parse_args()
    cfg = with_layers(QWEN3_5_35B_A3B, args.layers)
    if args.smoke:
        cfg = with_layers({**cfg, **SMOKE}, 4)
    device = "cpu" if args.smoke else "cuda"
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                           "layers": cfg["num_hidden_layers"], "torch": torch.__version__,
                           "model": "Qwen3.5-35B-A3B-shaped, random bf16 weights"}
    if not args.smoke:
        res.update(gpu=torch.cuda.get_device_name(), gpu_state_before=gpu_state(),
                   copy_GBps=copy_bandwidth() / 1e9)
    d = Path(tempfile.mkdtemp(prefix="qwen3_5-moe-"))
    (d / "config.json").write_text(json.dumps(cfg))
    t = time.perf_counter()
    engine = Engine(EngineConfig(model=str(d), load_format="dummy",
                                 dtype="float32" if args.smoke else "bfloat16", device=device,
                                 max_num_seqs=64 if args.smoke else 256,
                                 max_num_batched_tokens=8192,
                                 num_kv_blocks=256 if args.smoke else None))
    res["startup_s"] = time.perf_counter() - t
    res["state_slots"] = engine.runner.num_state_slots
    res["cuda_graphs"] = engine.runner.graphs is not None
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
        res["B1_limit_tok_s"] = bw / step_bytes(cfg, top_k, 1)
        experts = min(cfg["num_experts"], 64 * top_k)  # at most every expert per layer
        res["B64_limit_tok_s"] = 64 * bw / step_bytes(cfg, experts, 64)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res.get('gpu', 'cpu (smoke)')}  {res['date']}  layers {cfg['num_hidden_layers']}"
          f"  state slots {res['state_slots']}  graphs {res['cuda_graphs']}  startup "
          f"{res['startup_s']:.1f}s"
          + (f"  copy {res['copy_GBps']:.0f} GB/s" if "copy_GBps" in res else ""))
    for (name, value, unit), limit in zip(rows, ("B1_limit_tok_s", "B64_limit_tok_s"),
                                          strict=True):
        note = f"{value / res[limit]:.0%} of BW limit {res[limit]:.0f}" if limit in res else ""
        print(f"{name:<22} {value:10.1f} {unit:<14} {note}")


if __name__ == "__main__":
    main()
