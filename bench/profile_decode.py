"""Where does a batch-1 decode step go? Graph replay (GPU) vs the engine's host work per step.

    python bench/profile_decode.py [--layers 32] [--batch 1]

Prints: GPU time of one captured decode graph replay, the full Engine.step() time, their gap
(host overhead not hidden), and the top CUDA kernels of one replay from torch.profiler.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import model_dir, rand_prompts  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402
from services.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=model_dir(args.layers), load_format="dummy",
                                 dtype="bfloat16", device="cuda", kvcache_mem_mib=8192))
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(rand_prompts(args.batch, 128, 128256, 0)):
        engine.add_request(f"r{i}", p, params)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    n = 100
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    step_ms = (time.perf_counter() - t) / n * 1e3
    graphs = engine.runner.graphs
    assert graphs is not None
    graph, _ = graphs.graphs[graphs.bucket_for(args.batch)]
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    replay_ms = s.elapsed_time(e) / n
    print(f"batch {args.batch}: Engine.step {step_ms:.3f} ms, graph replay {replay_ms:.3f} ms, "
          f"host gap {step_ms - replay_ms:.3f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                    max_name_column_width=60))


if __name__ == "__main__":
    main()
