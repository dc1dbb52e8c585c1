"""Engine benchmarks B1-B4 and the prefix-cache case on a Llama-3-8B-shaped model.

Random bf16 weights (speed does not depend on values), built directly on the GPU with
`load_format="dummy"`. Peers measured in the same run: device copy bandwidth (B1's limit), bf16
matmul rate, and transformers' continuous batching (`generate_batch`) for B2/B3 when available.

    python bench/engine_bench.py [--only B1,B2,B3,B4,prefix,peers] [--layers N] [--out FILE]

Prints a short table (GPU, date, each result as a ratio to its limit / peer) and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.sampling_params import SamplingParams  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "hidden_act": "silu",
}


def model_dir(layers: int) -> str:
    d = Path(tempfile.mkdtemp(prefix="llama3-8b-"))
    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def weight_bytes(cfg: dict, decode: bool = False) -> int:
    """bf16 weight bytes; decode=True: the bytes one decode step reads (the input embedding
    table is untied from lm_head in Llama 3 and only one row of it is read)."""
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], \
        cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return 2 * (L * per_layer + (1 if decode else 2) * v * h + h)


def gpu_state() -> str:
    """nvidia-smi's name, SM clock (now / max), power (now / limit) and temperature."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,"
             "temperature.gpu", "--format=csv,noheader"], capture_output=True, text=True,
            timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi unavailable"


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    del a, b
    return 2 * n * 2 / times[len(times) // 2]  # bytes read + written


def matmul_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once; return output tok/s, mean TTFT and decode tok/s (batch)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{t0}", p, params)
    first: dict[str, float] = {}
    n_out = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            n_out += len(o.new_token_ids)
    total = time.perf_counter() - t0
    ttft = sum(first.values()) / max(len(first), 1)
    last_first = max(first.values())
    decode_tokens = n_out - len(prompts)
    return {"output_tok_s": n_out / total, "total_s": total, "mean_ttft_s": ttft,
            "last_ttft_s": last_first,
            "decode_tok_s": decode_tokens / max(total - last_first, 1e-9), "tokens": n_out}


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="peers,B1,B2,B3,B4,prefix")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kvcache-mem", type=int, default=None, help="MiB; default: measured")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--sync", action="store_true", help="async scheduling off (A/B)")
    ap.add_argument("--decode-short-context", type=int, default=512,
                    help="EngineConfig.decode_short_context (0: no short-context graphs, A/B)")
    ap.add_argument("--step-graph-tokens", type=int, default=None,
                    help="EngineConfig.step_graph_tokens (0: prefill steps eager, A/B)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/engine_bench.json")
    args = ap.parse_args()
    only = set(args.only.split(","))
    gpu = torch.cuda.get_device_name()
    res: dict = {"gpu": gpu, "date": datetime.date.today().isoformat(), "layers": args.layers,
                 "torch": torch.__version__, "async_scheduling": not args.sync,
                 "gpu_state_before": gpu_state()}
    cfg = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    wbytes = weight_bytes(cfg)
    if "peers" in only or "B1" in only:
        res["copy_GBps"] = copy_bandwidth() / 1e9
        res["matmul_TFLOPs"] = matmul_tflops()
    t = time.perf_counter()
    engine = Engine(EngineConfig(model=model_dir(args.layers), load_format="dummy",
                                 dtype="bfloat16", device="cuda", kvcache_mem_mib=args.kvcache_mem,
                                 enforce_eager=args.enforce_eager, max_num_seqs=256,
                                 max_num_batched_tokens=8192,
                                 async_scheduling=not args.sync,
                                 decode_short_context=args.decode_short_context,
                                 step_graph_tokens=args.step_graph_tokens))
    res["decode_short_context"] = args.decode_short_context
    res["step_graph_tokens"] = engine.config.resolved_step_graph_tokens
    res["startup_s"] = time.perf_counter() - t
    res["kv_capacity_tokens"] = engine.runner.num_blocks * engine.config.block_size
    vocab = cfg["vocab_size"]
    run(engine, rand_prompts(2, 64, vocab, 0), 8)  # warm-up
    rows = []
    if "B1" in only:
        r = run(engine, rand_prompts(1, 128, vocab, 1), 256)
        limit = res["copy_GBps"] * 1e9 / weight_bytes(cfg, decode=True)
        res["B1"] = dict(r, limit_tok_s=limit)
        rows.append(("B1 batch 1, 128 in/256 out", r["decode_tok_s"], "tok/s decode",
                     f"{r['decode_tok_s'] / limit:.0%} of BW limit {limit:.0f}; "
                     f"{r['decode_tok_s'] / 145.7:.2f}x gpt-fast(ref); "
                     f"TTFT {r['mean_ttft_s'] * 1e3:.1f} ms"))
    if "B2" in only:
        r = run(engine, rand_prompts(16, 128, vocab, 2), 256)
        res["B2"] = r
        rows.append(("B2 16 x 128/256", r["output_tok_s"], "out tok/s",
                     f"{r['output_tok_s'] / 1638:.2f}x gpt-fast(ref 1638)"))
    if "B3" in only:
        r = run(engine, rand_prompts(256, 128, vocab, 3), 128)
        res["B3"] = r
        rows.append(("B3 256 x 128/128", r["output_tok_s"], "out tok/s",
                     f"{r['output_tok_s'] / 1219:.2f}x transformers(ref 1219)"))
    if "B4" in only:
        engine.reset_prefix_cache()
        run(engine, rand_prompts(1, 4096, vocab, 7), 1)  # same shapes: nothing left to compile
        runs = []
        for seed in (4, 8, 9):  # median of three fresh prompts (runs vary by ~3%)
            engine.reset_prefix_cache()
            runs.append(run(engine, rand_prompts(1, 4096, vocab, seed), 1))
        runs.sort(key=lambda x: x["mean_ttft_s"])
        r = dict(runs[1], runs_ttft_s=[x["mean_ttft_s"] for x in runs])
        pf = 4096 / r["mean_ttft_s"]
        # the layers' matmuls (the embedding is a lookup; lm_head runs for the last token
        # only) plus causal attention (QK^T and PV, half of n^2 each, over all q heads)
        h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
        layer_params = (weight_bytes(cfg, decode=True) / 2 - cfg["vocab_size"] * h - h) / L
        flops = L * (2 * layer_params * 4096 + 2 * 4096 * 4096 * h)
        res["B4"] = dict(r, prefill_tok_s=pf, mfu=flops / r["mean_ttft_s"] / 1e12 /
                         res.get("matmul_TFLOPs", 789))
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)  # cudaFree + retry
        res["B4"]["alloc_retries"] = retries
        rows.append(("B4 prefill 4096", pf, "tok/s",
                     f"{res['B4']['mfu']:.0%} of matmul rate; allocator retries {retries}"))
    if "prefix" in only:
        engine.reset_prefix_cache()
        system = rand_prompts(1, 2000, vocab, 5)[0]
        tails = rand_prompts(64, 32, vocab, 6)
        cold = run(engine, [system + tails[0]], 1)
        before = engine.stats()["prefix_cache_hit_tokens"]
        warm = run(engine, [system + t for t in tails[1:]], 16)
        skipped = engine.stats()["prefix_cache_hit_tokens"] - before
        single = run(engine, [system + tails[5][::-1]], 1)
        res["prefix"] = {"cold_ttft_s": cold["mean_ttft_s"], "warm_single_ttft_s":
                         single["mean_ttft_s"], "skipped_tokens": skipped,
                         "batch63_mean_ttft_s": warm["mean_ttft_s"]}
        rows.append(("prefix 2000-tok shared, TTFT", single["mean_ttft_s"] * 1e3, "ms warm",
                     f"cold {cold['mean_ttft_s'] * 1e3:.1f} ms; skipped {skipped} tokens"))
    res["gpu_state_after"] = gpu_state()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{gpu}  {res['date']}  torch {torch.__version__}  layers {args.layers}  "
          f"startup {res['startup_s']:.1f}s  KV {res['kv_capacity_tokens']} tokens  "
          f"async {not args.sync}")
    if "copy_GBps" in res:
        print(f"peers: copy {res['copy_GBps']:.0f} GB/s, bf16 matmul {res['matmul_TFLOPs']:.0f} "
              f"TFLOP/s, weights {wbytes / 1e9:.2f} GB")
    for name, value, unit, note in rows:
        print(f"{name:32s} {value:10.1f} {unit:12s} {note}")


if __name__ == "__main__":
    main()
