"""MoE expert offload (services/engine/layers/moe_offload.py): decode tok/s of a Qwen3-30B-A3B-
shaped model (random bf16 weights, `--layers` of its 48 layers) with no, half and all experts in
host memory, each offload mode ("cpu": computed on CPU threads; "stream": copied to the GPU when
used), against the links measured in the same run.

    python bench/moe_offload.py [--layers 8] [--batches 1,16] [--tokens 64] [--out FILE]
    python bench/moe_offload.py --smoke      # same code on CPU at tiny sizes (script check)

Printed limits, per row: "cpu" cannot beat host-memory bandwidth / the host expert bytes a
step reads (a CPU copy measured here); "stream" cannot beat PCIe host->device bandwidth
(pinned, measured here) / the bytes of the host experts a step uses. Experts used per step are
estimated as E * (1 - (1 - k/E)^B) per layer (uniform routing; random weights route about so).
The all-on-GPU rows run with CUDA graphs (the engine's default) and eagerly (as every offload
row must). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
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

# Qwen/Qwen3-30B-A3B's config.json (sizes as published)
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=1000,
)
# (row name, EngineConfig overrides); "half" = the last E/2 experts of every layer
CASES: list[tuple[str, dict[str, Any]]] = [
    ("gpu, CUDA graphs", {}),
    ("gpu, eager", {"enforce_eager": True}),
    ("half on host, cpu", {"num_experts_offload_per_rank": -2}),
    ("all on host, cpu", {"cpu_moe": True}),
    ("half on host, stream", {"num_experts_offload_per_rank": -2, "moe_offload_mode": "stream"}),
    ("all on host, stream", {"cpu_moe": True, "moe_offload_mode": "stream"}),
]


def pcie_h2d_bandwidth() -> float:
    """Pinned host -> device copy, 1 GiB, median of 10 (bytes/s)."""
    n = 1 << 29
    src = torch.empty(n, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * n / times[len(times) // 2]


def host_copy_bandwidth() -> float:
    """CPU tensor copy (bytes read + written per second), 1 GiB, median of 5: what the CPU's
    threads can stream from host memory, the limit of the "cpu" mode."""
    n = 1 << 29
    a = torch.empty(n, dtype=torch.bfloat16).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    times = sorted(times[1:])
    return 2 * 2 * n / times[len(times) // 2]


def expert_bytes(cfg: dict[str, Any]) -> int:
    return 2 * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]  # bf16 gate, up, down


def used_per_layer(cfg: dict[str, Any], experts: int, batch: int) -> float:
    """Expected distinct experts among `experts` that a step of `batch` tokens routes to."""
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    return experts * (1 - (1 - k / e) ** batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--only", default=None, help="comma-separated row numbers (0-5)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: a script check")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/moe_offload.json")
    args = ap.parse_args()
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    if args.smoke:
        cfg.update(SMOKE, num_hidden_layers=2)
    device = "cpu" if args.smoke else "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    d = Path(tempfile.mkdtemp(prefix="qwen3-moe-"))
    (d / "config.json").write_text(json.dumps(cfg))
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "config": cfg,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "host_copy_GBps": host_copy_bandwidth() / 1e9,
        "rows": [],
    }
    if not args.smoke:
        res.update(
            gpu=torch.cuda.get_device_name(),
            gpu_state_before=gpu_state(),
            copy_GBps=copy_bandwidth() / 1e9,
            pcie_h2d_GBps=pcie_h2d_bandwidth() / 1e9,
        )
    only = None if args.only is None else {int(i) for i in args.only.split(",")}
    e, layers = cfg["num_experts"], cfg["num_hidden_layers"]
    for index, (name, overrides) in enumerate(CASES):
        if only is not None and index not in only:
            continue
        overrides = dict(overrides)
        if overrides.get("num_experts_offload_per_rank") == -2:
            overrides["num_experts_offload_per_rank"] = e // 2
        host = e if overrides.get("cpu_moe") else overrides.get("num_experts_offload_per_rank", 0)
        t = time.perf_counter()
        engine = Engine(
            EngineConfig(
                model=str(d),
                load_format="dummy",
                dtype="float32" if args.smoke else "bfloat16",
                device=device,
                max_num_seqs=max(batches),
                num_kv_blocks=64 if args.smoke else 2048,
                **overrides,
            )
        )
        row: dict[str, Any] = {
            "name": name,
            "host_experts": host,
            "startup_s": time.perf_counter() - t,
        }
        if device == "cuda":
            row["gpu_mem_GiB"] = torch.cuda.memory_allocated() / 2**30
        run(engine, rand_prompts(2, 32, cfg["vocab_size"], 0), 4)  # warm-up
        for b in batches:
            out = run(engine, rand_prompts(b, 128, cfg["vocab_size"], b), args.tokens)
            row[f"B{b}_decode_tok_s"] = out["decode_tok_s"]
            step_host = used_per_layer(cfg, host, b) * layers * expert_bytes(cfg)
            if host and "stream" in name and "pcie_h2d_GBps" in res:
                row[f"B{b}_limit_tok_s"] = b * res["pcie_h2d_GBps"] * 1e9 / step_host
            elif host and "stream" not in name:
                row[f"B{b}_limit_tok_s"] = b * res["host_copy_GBps"] * 1e9 / step_host
        res["rows"].append(row)
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(
        f"\n{res.get('gpu', 'cpu (smoke)')}  {res['date']}  Qwen3-30B-A3B shape, "
        f"{layers} of 48 layers, {'fp32' if args.smoke else 'bf16'}, "
        f"{res['cpu_threads']} CPU threads"
    )
    print(
        "links: host copy {:.1f} GB/s (r+w)".format(res["host_copy_GBps"])
        + (
            f", PCIe H2D {res['pcie_h2d_GBps']:.1f} GB/s pinned, "
            f"HBM copy {res['copy_GBps']:.0f} GB/s"
            if "pcie_h2d_GBps" in res
            else ""
        )
    )
    head = "".join(f"{f'B{b} tok/s':>12}{'limit':>9}" for b in batches)
    print(f"{'case':<24}{'host':>5}{'GiB':>7}{head}")
    for row in res["rows"]:
        cells = "".join(
            f"{row[f'B{b}_decode_tok_s']:12.1f}"
            + (f"{row[f'B{b}_limit_tok_s']:9.1f}" if f"B{b}_limit_tok_s" in row else f"{'':>9}")
            for b in batches
        )
        print(f"{row['name']:<24}{row['host_experts']:>5}{row.get('gpu_mem_GiB', 0):7.1f}{cells}")


if __name__ == "__main__":
    main()
