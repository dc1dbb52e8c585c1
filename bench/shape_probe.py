"""Why is a burst's first prefill step slow? Times a prefill step's host launch per batch shape,
the first time the engine sees a shape and again with fresh prompts, each after the GPU idled.

    python bench/shape_probe.py [--layers 32] [--idle 1.0] [--profile 2] [--pad 0|1]
                                [--step-graphs N] [--shapes 1x128,4x128,...]

For each (sequences x prompt tokens) it adds fresh prompts (max_tokens 2), then times the step
that launches their prefill: the host launch (Engine.last_phases) and the step until its tokens
are back. `--profile N` also runs N more new shapes under cProfile and prints where the launch
spends its time. Writes JSON to $OUT.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import model_dir, rand_prompts  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402
from services.engine.sampling_params import SamplingParams  # noqa: E402

SHAPES = [(4, 128), (11, 128), (18, 128), (53, 128), (64, 128), (7, 100), (3, 700)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_step(engine: Engine, seqs: int, length: int, seed: int, idle: float,
                 profile: cProfile.Profile | None = None) -> dict:
    """Idle, add `seqs` fresh prompts, run one step: its launch and total ms; then finish."""
    sync()
    time.sleep(idle)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(rand_prompts(seqs, length, 128_000, seed)):
        engine.add_request(f"s{seed}-{i}", p, params)
    t = time.perf_counter()
    if profile is not None:
        profile.enable()
    engine.step()
    if profile is not None:
        profile.disable()
    phases = engine.last_phases
    sync()
    total = (time.perf_counter() - t) * 1e3
    while engine.has_unfinished():
        engine.step()
    return {"seqs": seqs, "length": length, "tokens": seqs * length,
            "launch_ms": round(phases[1] * 1e3, 2), "step_ms": round(total, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--idle", type=float, default=1.0, help="s the GPU idles before each step")
    ap.add_argument("--profile", type=int, default=2, help="new shapes run under cProfile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pad", choices=("auto", "0", "1"), default="auto",
                    help="EngineConfig.pad_eager_steps (auto: on CUDA)")
    ap.add_argument("--step-graphs", type=int, default=None,
                    help="EngineConfig.step_graph_tokens (default: auto, 512 on CUDA; 0: off)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="sequences x prompt tokens, comma-separated")
    ap.add_argument("--torch-profile", action="store_true",
                    help="also profile one new 4 x 128 step with torch.profiler (host ops)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/shape_probe.json")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=model_dir(args.layers), load_format="dummy",
                                 device=args.device, quantization=None,
                                 pad_eager_steps=None if args.pad == "auto" else args.pad == "1",
                                 step_graph_tokens=args.step_graphs,
                                 dtype="bfloat16" if args.device == "cuda" else "float32"))
    prefill_step(engine, 2, 64, 0, 0.0)  # a first request through every path
    rows, seed = [], 1
    print(f"pad_eager_steps={engine.runner.pad_eager_steps} "
          f"step_graph_tokens={engine.config.resolved_step_graph_tokens}")
    print(f"{'seqs x len':>11} {'tokens':>7} {'1st launch':>11} {'1st step':>9} "
          f"{'2nd launch':>11} {'2nd step':>9}   (ms)")
    for seqs, length in (map(int, x.split("x")) for x in args.shapes.split(",")):
        first = prefill_step(engine, seqs, length, seed, args.idle)
        again = prefill_step(engine, seqs, length, seed + 1, args.idle)
        seed += 2
        rows.append({"first": first, "again": again})
        print(f"{seqs:>5} x {length:<4} {seqs * length:>7} {first['launch_ms']:>11} "
              f"{first['step_ms']:>9} {again['launch_ms']:>11} {again['step_ms']:>9}", flush=True)
    profiles = []
    for k in range(args.profile):
        prof = cProfile.Profile()
        r = prefill_step(engine, 5 + 6 * k, 128 + 8 * k, 1000 + k, args.idle, prof)
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(14)
        stats.sort_stats("cumulative").print_stats(22)
        print(f"--- cProfile of a new shape {r['seqs']} x {r['length']}: launch "
              f"{r['launch_ms']} ms (profiled)")
        text = "\n".join(line[:150] for line in buf.getvalue().splitlines() if line.strip())
        print(text)
        profiles.append(dict(r, stats=text))
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=acts) as tp:
            r = prefill_step(engine, 4, 120, 2000, args.idle)
        print(f"--- torch.profiler of a new shape 4 x 120: launch {r['launch_ms']} ms")
        table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                        max_name_column_width=60)
        print(table)
        profiles.append(dict(r, stats=table))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    Path(args.out).write_text(json.dumps({"device": name, "date": time.strftime("%Y-%m-%d"),
                                          "rows": rows, "profiles": profiles}, indent=2))


if __name__ == "__main__":
    main()
