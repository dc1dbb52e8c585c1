"""Time to first token of a single prompt, whole-step CUDA graphs on against off, in one process.

    python bench/ttft_probe.py [--layers 32] [--lengths 16,128,500] [--rounds 3]

One engine (Llama-3-8B shape, random bf16 weights) with step graphs captured. Each round runs
every prompt length (256 new tokens at the B1 length, 16 otherwise) once with the graphs and
once with the runner's `step_graphs` set aside, alternating which goes first; the GPU idles
0.5 s before each request. Reports the median TTFT and, for the B1 length, the decode rate.
Writes JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import model_dir, rand_prompts, run  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402

B1_LENGTH = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lengths", default="16,128,500")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/ttft_probe.json")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=model_dir(args.layers), load_format="dummy",
                                 dtype="bfloat16", device="cuda"))
    graphs = engine.runner.step_graphs
    assert graphs is not None, "step graphs are off: nothing to compare"
    run(engine, rand_prompts(2, 64, 128_000, 0), 8)  # warm-up
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict[str, dict[int, list[dict]]] = {"graphs": {}, "eager": {}}
    seed = 1
    for r in range(args.rounds):
        for mode in (("graphs", "eager") if r % 2 == 0 else ("eager", "graphs")):
            engine.runner.step_graphs = graphs if mode == "graphs" else None
            for n in lengths:
                torch.cuda.synchronize()
                time.sleep(0.5)
                out = run(engine, rand_prompts(1, n, 128_000, seed),
                          256 if n == B1_LENGTH else 16)
                seed += 1
                results[mode].setdefault(n, []).append(out)
    engine.runner.step_graphs = graphs
    summary = {}
    print(f"{torch.cuda.get_device_name()}  {time.strftime('%Y-%m-%d')}  median of "
          f"{args.rounds} (ms; decode tok/s at {B1_LENGTH} tokens, 256 out)")
    print(f"{'prompt':>7} {'TTFT graphs':>12} {'TTFT eager':>11} {'ratio':>6} "
          f"{'decode graphs':>14} {'decode eager':>13}")
    for n in lengths:
        row = {}
        for mode in ("graphs", "eager"):
            runs = results[mode][n]
            row[mode] = {"ttft_ms": statistics.median(x["mean_ttft_s"] for x in runs) * 1e3,
                         "decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs),
                         "runs_ttft_ms": [round(x["mean_ttft_s"] * 1e3, 2) for x in runs]}
        summary[n] = row
        g, e = row["graphs"], row["eager"]
        dec = (f"{g['decode_tok_s']:>14.1f} {e['decode_tok_s']:>13.1f}" if n == B1_LENGTH
               else "")
        print(f"{n:>7} {g['ttft_ms']:>12.2f} {e['ttft_ms']:>11.2f} "
              f"{e['ttft_ms'] / g['ttft_ms']:>5.2f}x {dec}")
    Path(args.out).write_text(json.dumps({
        "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
        "layers": args.layers, "rounds": args.rounds, "step_graph_buckets": graphs.buckets,
        "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
