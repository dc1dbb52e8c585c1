"""Where a 4,096-token prefill (B4) goes, and what each prefill option buys, in one process.

    python bench/prefill_lab.py [--layers 32] [--rounds 5] [--micro-only | --engine-only]
                                [--kvcache-mem MiB] [--alloc-conf CONF] [--out FILE]

1. Limits measured now: copy bandwidth, bf16 matmul rate (8192^3), GPU clocks / power.
2. GEMMs of one Llama-3-8B layer at M = 4,096 through cuBLAS (TFLOP/s each); the gate/up
   GEMM with SiLU·mul in its epilogue (kernels/gated_gemm.py, every tile config, with and
   without Triton's warp specialisation) against cuBLAS + the SiLU·mul kernel, at several M.
3. The engine (KV cache from 90% of the GPU as engine_bench, or --kvcache-mem) timing add_request
   -> first token of a 4,096-token prompt under each combination of the options, interleaved
   over `rounds` (median), with the allocator's cudaMalloc / cudaFree calls meanwhile: paged
   Triton attention vs cuDNN's fused attention (FLOTILLA_DENSE_PREFILL), the fused gate/up GEMM
   (FLOTILLA_GATED_GEMM).
4. For the fastest combination: the host's time before the first kernel, the device span of the
   forward, and the tail (sampling, copy, postprocess); the top kernels and the device's idle
   gaps (torch.profiler) of it and of "dense".
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import (  # noqa: E402
    LLAMA3_8B,
    copy_bandwidth,
    gpu_state,
    matmul_tflops,
    model_dir,
    rand_prompts,
    run,
)
from kernels import dense_attention, selection  # noqa: E402
from kernels.activation import silu_and_mul_triton  # noqa: E402
from kernels.gated_gemm import CONFIGS, gated_gemm_triton  # noqa: E402
from services.engine.engine import Engine, EngineConfig  # noqa: E402

H, INTER, KV = 4096, 14336, 1024


def ms(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def micro(res: dict[str, Any]) -> None:
    torch.manual_seed(0)
    shapes = {"qkv": (H + 2 * KV, H), "o": (H, H), "gate_up": (2 * INTER, H), "down": (H, INTER)}
    m = 4096
    out: dict[str, Any] = {}
    print(f"\n== cuBLAS GEMMs at M = {m} ==")
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
        t = ms(lambda x=x, w=w: F.linear(x, w))
        out[name] = {"ms": t, "tflops": 2 * m * n * k / t / 1e9}
        print(f"  {name:8s} {t * 1e3:8.1f} us {out[name]['tflops']:6.0f} TFLOP/s")
    print("\n== gate/up + SiLU·mul: cuBLAS + kernel vs fused (kernels/gated_gemm.py) ==")
    w = torch.randn(2 * INTER, H, dtype=torch.bfloat16, device="cuda") / H ** 0.5
    gated: dict[str, Any] = {}
    for mm in (256, 512, 1024, 2048, 4096, 8192):
        x = torch.randn(mm, H, dtype=torch.bfloat16, device="cuda")
        ref = silu_and_mul_triton(F.linear(x, w))
        t_ref = ms(lambda x=x: silu_and_mul_triton(F.linear(x, w)))
        flops = 2 * mm * 2 * INTER * H
        row: dict[str, Any] = {"cublas_silu_ms": t_ref}
        best = (float("inf"), "")
        for cfg, ws in itertools.product(CONFIGS, (False, True)):
            if ws and cfg[3] < 8:  # failed to build on Triton 3.6 (NVGPUWarpSpecialization)
                continue
            tag = "x".join(map(str, cfg)) + ("-ws" if ws else "")
            try:
                y = gated_gemm_triton(x, w, config=cfg, warp_spec=ws)
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                t = ms(lambda x=x, cfg=cfg, ws=ws: gated_gemm_triton(x, w, config=cfg,
                                                                     warp_spec=ws))
            except Exception as exc:  # noqa: BLE001 - a config this Triton cannot build
                row[tag] = f"failed: {str(exc).splitlines()[0][:80]}"
                continue
            row[tag] = {"ms": t, "err": err}
            if err < 1e-2 and t < best[0]:
                best = (t, tag)
        row["best"] = best[1]
        gated[str(mm)] = row
        bt = best[0]
        print(f"  M={mm:5d} cuBLAS+silu {t_ref * 1e3:8.1f} us ({flops / t_ref / 1e9:4.0f} TFLOP/s)"
              f"  fused best {best[1]:>18s} {bt * 1e3:8.1f} us ({flops / bt / 1e9:4.0f})"
              f"  ratio {t_ref / bt:.3f}")
    out["gated"] = gated
    res["micro"] = out


def ttft(engine: Engine, prompt: list[int], start: torch.cuda.Event | None = None) -> float:
    """add_request -> first token (s) of one prompt, with nothing cached and the GPU idle;
    `start` is recorded just before the request."""
    engine.reset_prefix_cache()
    torch.cuda.synchronize()
    if start is not None:
        start.record()
    return float(run(engine, [prompt], 1)["mean_ttft_s"])


VARIANTS = {  # name: (cuDNN attention for the long prompt, fused gate/up GEMM)
    "paged": (False, False),
    "paged+gated": (False, True),
    "dense": (True, False),
    "dense+gated": (True, True),
}


def apply(variant: str, warm_max: int) -> None:
    dense, gated = VARIANTS[variant]
    dense_attention._warm_max = warm_max if dense else 0
    selection.install(replace(selection.current(), gated_gemm="1" if gated else "0"))


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def alloc_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOC_KEYS}


def timeline(engine: Engine, prompt: list[int]) -> dict[str, float]:
    """Host -> first kernel, forward device span and tail of one request (GPU idle before it, so
    an event's device time is the moment the host enqueued it)."""
    model = engine.runner.model
    marks: dict[str, torch.cuda.Event] = {}

    def mark(name: str) -> Any:
        def hook(*_: Any) -> None:
            if name not in marks:
                marks[name] = torch.cuda.Event(enable_timing=True)
                marks[name].record()
        return hook

    h1 = model.model.embed_tokens.register_forward_pre_hook(mark("embed"))
    h2 = model.lm_head.register_forward_hook(mark("lm_head"))
    start = torch.cuda.Event(enable_timing=True)
    try:
        first = ttft(engine, prompt, start)
        torch.cuda.synchronize()
    finally:
        h1.remove()
        h2.remove()
    to_embed = start.elapsed_time(marks["embed"])
    span = marks["embed"].elapsed_time(marks["lm_head"])
    return {"ttft_ms": first * 1e3, "host_to_first_kernel_ms": to_embed,
            "forward_span_ms": span, "tail_ms": first * 1e3 - to_embed - span}


class NvmlSampler:
    """SM clock (MHz), power (W) and clock-throttle reasons, sampled on a thread every ~1 ms."""

    def __init__(self) -> None:
        import threading

        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.samples: list[tuple[float, int, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n, h = self.nvml, self.handle
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                                 n.nvmlDeviceGetPowerUsage(h) / 1e3,
                                 n.nvmlDeviceGetCurrentClocksThrottleReasons(h)))
            time.sleep(0.001)

    def __enter__(self) -> NvmlSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples[-1:]
        clocks, power = [s[1] for s in inside], [s[2] for s in inside]
        reasons = 0
        for s in inside:
            reasons |= s[3]
        return {"sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
                "power_w_median": statistics.median(power), "power_w_max": max(power),
                "throttle_reasons": hex(reasons), "samples": len(inside)}


def layer_times(engine: Engine, prompt: list[int], profiled: bool) -> dict[str, Any]:
    """One request with an event before every decoder layer (and after lm_head): the per-layer
    device times, the forward span and the SM clock / power meanwhile; `profiled` runs it under
    torch.profiler (CUDA activity) as the profiles above were."""
    from torch.profiler import ProfilerActivity, profile

    model = engine.runner.model
    events: list[torch.cuda.Event] = []

    def mark(*_: Any) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)

    hooks = [layer.register_forward_pre_hook(mark) for layer in model.model.layers]
    hooks.append(model.lm_head.register_forward_hook(mark))
    try:
        with NvmlSampler() as nv:
            time.sleep(0.02)
            if profiled:
                with profile(activities=[ProfilerActivity.CUDA]):
                    t0 = time.perf_counter()
                    first = ttft(engine, prompt)
            else:
                t0 = time.perf_counter()
                first = ttft(engine, prompt)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    per_layer = [a.elapsed_time(b) for a, b in itertools.pairwise(events)]
    return {"profiled": profiled, "ttft_ms": first * 1e3,
            "span_ms": events[0].elapsed_time(events[-1]),
            "layer_ms_median": statistics.median(per_layer[:-1]),
            "layer_ms_min": min(per_layer[:-1]), "layer_ms_max": max(per_layer[:-1]),
            "slowest_layers": sorted(range(len(per_layer) - 1), key=lambda i: -per_layer[i])[:3],
            "nvml": nv.summary(t0, t1)}


def first_calls(res: dict[str, Any]) -> None:
    """The fused gate/up GEMM at new prompt lengths: a first call that compiles takes ~1 s."""
    w = torch.randn(2 * INTER, H, dtype=torch.bfloat16, device="cuda") / H ** 0.5
    times = {}
    for m in (4096, 4100, 4111, 300, 4096):
        x = torch.randn(m, H, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        gated_gemm_triton(x, w)
        torch.cuda.synchronize()
        times[m] = (time.perf_counter() - t) * 1e3
    res["gated_first_call_ms"] = times
    print("fused gate/up GEMM, first call per M (ms): "
          + ", ".join(f"{m}: {t:.1f}" for m, t in times.items()))


def clocks(res: dict[str, Any], engine: Engine, variant: str, warm_max: int) -> None:
    first_calls(res)
    apply(variant, warm_max)
    prompts = rand_prompts(7, 4096, int(LLAMA3_8B["vocab_size"]), 21)
    runs = [layer_times(engine, prompts[i], profiled=i in (3, 4)) for i in range(7)]
    res["clocks"] = {"variant": variant, "runs": runs}
    print(f"\n== {variant}: per-layer device times, clocks and power (runs 4 and 5 profiled) ==")
    for r in runs:
        nv = r["nvml"]
        print(f"  {'prof ' if r['profiled'] else 'plain'} ttft {r['ttft_ms']:6.1f} span "
              f"{r['span_ms']:6.1f} ms  layer med {r['layer_ms_median']:.3f} min "
              f"{r['layer_ms_min']:.3f} max {r['layer_ms_max']:.3f} (slowest {r['slowest_layers']})"
              f"  SM {nv['sm_mhz_median']:.0f} (min {nv['sm_mhz_min']}) MHz, "
              f"{nv['power_w_median']:.0f} W (max {nv['power_w_max']:.0f}), throttle "
              f"{nv['throttle_reasons']}, {nv['samples']} samples")


def engine_ab(res: dict[str, Any], layers: int, rounds: int, kvcache_mem: int | None,
              only_clocks: bool = False) -> None:
    engine = Engine(EngineConfig(model=model_dir(layers), load_format="dummy", dtype="bfloat16",
                                 device="cuda", max_num_seqs=256, max_num_batched_tokens=8192,
                                 kvcache_mem_mib=kvcache_mem))
    res["kv_capacity_tokens"] = engine.runner.num_blocks * engine.config.block_size
    res["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    selection.install(replace(selection.current(), dense_prefill="1"))
    engine.runner.warm_up_dense_attention()
    warm_max = dense_attention._warm_max
    vocab = int(LLAMA3_8B["vocab_size"])
    prompts = rand_prompts(rounds + 2, 4096, vocab, 11)
    for v in VARIANTS:  # compile / autotune every path first
        apply(v, warm_max)
        ttft(engine, prompts[-1])
        ttft(engine, prompts[-2])
    if only_clocks:
        clocks(res, engine, "dense+gated", warm_max)
        return
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    allocs: dict[str, dict[str, int]] = {v: dict.fromkeys(ALLOC_KEYS, 0) for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS:
            apply(v, warm_max)
            before = alloc_counts()
            times[v].append(ttft(engine, prompts[r]))
            for k, n in alloc_counts().items():
                allocs[v][k] += n - before[k]
    print(f"\n== B4 through the engine, add_request -> first token, median of {rounds} ==")
    out: dict[str, Any] = {}
    for v, ts in times.items():
        med = statistics.median(ts)
        out[v] = {"ttft_ms": [t * 1e3 for t in ts], "median_ms": med * 1e3,
                  "prefill_tok_s": 4096 / med, "allocator_calls": allocs[v]}
        print(f"  {v:14s} {med * 1e3:7.1f} ms  {4096 / med:8.0f} tok/s  "
              f"(runs {' '.join(f'{t * 1e3:.1f}' for t in ts)}; cudaMalloc/cudaFree/retries "
              f"over the runs {'/'.join(str(allocs[v][k]) for k in ALLOC_KEYS)})")
    best = min(out, key=lambda v: out[v]["median_ms"])
    apply(best, warm_max)
    tl = [timeline(engine, prompts[i]) for i in range(3)]
    out["timeline_best"] = {"variant": best, "runs": tl}
    print(f"  timeline ({best}): " + "; ".join(
        f"host->first kernel {t['host_to_first_kernel_ms']:.2f} ms, forward span "
        f"{t['forward_span_ms']:.1f} ms, tail {t['tail_ms']:.2f} ms" for t in tl))
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.profile_decode import gaps
    for v in dict.fromkeys([best, "dense"]):
        apply(v, warm_max)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("request"):
                ttft(engine, prompts[1])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                          max_name_column_width=50)
        out[f"profile_{v}"] = table
        print(f"-- profile ({v})")
        print("\n".join(line for line in table.splitlines()[3:17] if line.strip("- ")))
        gaps(prof, top=6)
    res["engine"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--micro-only", action="store_true")
    ap.add_argument("--engine-only", action="store_true")
    ap.add_argument("--kvcache-mem", type=int, default=None, help="MiB; default: 90%% of the GPU")
    ap.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF for this run")
    ap.add_argument("--clocks", action="store_true",
                    help="engine: per-layer times, SM clock and power, plain vs profiled, only")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/prefill_lab.json")
    args = ap.parse_args()
    if args.alloc_conf is not None:  # read by torch at the first CUDA allocation
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "date":
                           datetime.date.today().isoformat(), "torch": torch.__version__,
                           "triton": triton.__version__, "state_before": gpu_state()}
    res["copy_GBps"] = copy_bandwidth() / 1e9
    res["matmul_TFLOPs"] = matmul_tflops()
    print(f"{res['gpu']} {res['date']}: copy {res['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{res['matmul_TFLOPs']:.0f} TFLOP/s; {res['state_before']}")
    try:
        if not args.engine_only:
            micro(res)
        if not args.micro_only:
            engine_ab(res, args.layers, args.rounds, args.kvcache_mem, args.clocks)
    finally:
        res["state_after"] = gpu_state()
        print(f"GPU after: {res['state_after']}")
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
