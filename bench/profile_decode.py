"""Where does a decode step go? Graph replay (GPU) vs the engine's host work per step; or, with
--prefill N, the kernels of one N-token prefill.

    python bench/profile_decode.py [--layers 32] [--batch 1] [--sync] [--prefill 4096]

Decode prints: GPU time of one captured decode graph replay, the full Engine.step() time, their
gap (host work not hidden: with async scheduling the host prepares step N+1 while the device
runs step N, so the gap should shrink to the launch of the step), and the top CUDA kernels of one
replay from torch.profiler. Prefill prints the top CUDA kernels of one eager prefill.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import model_dir, rand_prompts  # noqa: E402
from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.sampling_params import SamplingParams  # noqa: E402


def table(prof: profile, rows: int = 16) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                     max_name_column_width=60)


def decode(engine: Engine, batch: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(rand_prompts(batch, 128, 128256, 0)):
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
    # the graph the timed steps replayed (short-context while the sequences fit), then the other
    max_seq_len = 128 + 20 + n
    key = graphs.graph_for(batch, max_seq_len)
    others = [k for k in graphs.graphs if k[0] == key[0] and k != key]
    for k in [key, *others]:
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(n):
            graphs.graphs[k][0].replay()
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e) / n
        print(f"  {'short' if k[1] else 'long'}-context graph of bucket {k[0]}: replay {ms:.3f} ms")
        if k == key:
            replay_ms = ms
    graph = graphs.graphs[key][0]
    print(f"batch {batch} (async {engine.async_scheduling}, seq_len <= {max_seq_len}): "
          f"Engine.step {step_ms:.3f} ms, graph replay {replay_ms:.3f} ms, "
          f"host gap {step_ms - replay_ms:.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    print(table(prof))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    print("five Engine.step() calls, by CPU time:")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20,
                                    max_name_column_width=60))


def gaps(prof: profile, top: int = 8, host_range: str = "request") -> None:
    """Device idle time inside the profiled span: kernel intervals merged, the largest gaps
    with the kernels on either side (idle between kernels = launch latency or host waits), and
    how long the host range `host_range` (add_request -> token) runs before the first kernel
    and after the last."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    if not kernels:
        return
    ranges = [e.time_range for e in prof.events() if e.name == host_range]
    if ranges:
        r = ranges[0]
        print(f"host range {(r.end - r.start) / 1e3:.1f} ms: first kernel after "
              f"{(kernels[0][0] - r.start) / 1e3:.1f} ms, last kernel ends "
              f"{(r.end - max(k[1] for k in kernels)) / 1e3:.1f} ms before its end")
    busy, holes, end, prev = 0.0, [], kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            holes.append((start - end, prev, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    span = end - kernels[0][0]
    print(f"device span {span / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms, idle "
          f"{(span - busy) / 1e3:.1f} ms in {len(holes)} gaps; largest:")
    for size, before, after in sorted(holes, reverse=True)[:top]:
        print(f"  {size:8.1f} us  after {before[:50]}  before {after[:50]}")


def prefill(engine: Engine, length: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def once(tag: str) -> None:
        engine.reset_prefix_cache()
        engine.add_request(tag, rand_prompts(1, length, 128256, hash(tag) % 1000)[0], params)
        while engine.has_unfinished():
            engine.step()

    once("warm")
    torch.cuda.synchronize()
    t = time.perf_counter()
    once("timed")
    torch.cuda.synchronize()
    print(f"prefill {length}: {(time.perf_counter() - t) * 1e3:.1f} ms wall")
    # Where does the host spend it? The step that launches the prefill vs the wait for its token
    # (with the device busy throughout if the launch never waits on the device).
    engine.reset_prefix_cache()
    engine.add_request("split", rand_prompts(1, length, 128256, 7)[0], params)
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.set_sync_debug_mode("warn")  # any synchronising call in the launch warns
    t = time.perf_counter()
    start.record()
    engine.step()
    launched = time.perf_counter() - t
    torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished():
        engine.step()
    end.record()
    torch.cuda.synchronize()
    print(f"prefill {length}: launch step {launched * 1e3:.1f} ms, token after "
          f"{(time.perf_counter() - t) * 1e3:.1f} ms, device span {start.elapsed_time(end):.1f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("request"):
            once("profiled")
        torch.cuda.synchronize()
    print(table(prof, 12))
    gaps(prof)
    print("by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                    max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill of N tokens")
    ap.add_argument("--sync", action="store_true", help="async scheduling off")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=model_dir(args.layers), load_format="dummy",
                                 dtype="bfloat16", device="cuda", kvcache_mem_mib=16384,
                                 async_scheduling=not args.sync))
    if args.prefill:
        prefill(engine, args.prefill)
    else:
        decode(engine, args.batch)


if __name__ == "__main__":
    main()
