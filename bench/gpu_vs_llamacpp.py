"""flotilla's engine against llama.cpp built with CUDA, on the same GPU and the same Q4_K_M GGUF
(Llama-3-8B shape, random weights quantized by our code; issue 26).

    python bench/gpu_vs_llamacpp.py [--gguf PATH] [--jobs 16] [--repetitions 5] [--build-only]
    python bench/gpu_vs_llamacpp.py --smoke   # CPU, tiny model, CPU build of llama.cpp: a check

1. Starts building llama-bench and llama-batched-bench (CUDA, sm_90, only those targets) from
   the llama-cpp-python sdist's sources (bench/llamacpp_build.py; the trimmed sources
   build/llamacpp-src.tar.gz travel to the device) in the background, niced, into
   build/llamacpp-cuda (kept: a second run on a warm machine skips the build).
2. Meanwhile writes the GGUF (generated and quantized on the GPU; kept in build/ and reused) and
   measures flotilla's engine with the server's defaults (EngineSettings; KV cache 4 GiB):
   pp512 (a 512-token prompt to its first token), tg128 (a 1-token prompt, 128 decode steps),
   B16 (16 prompts of 512 tokens, 128 tokens each: prefill tok/s to the last first token,
   decode tok/s after it). Each case warmed up once, then the median of --repetitions runs.
   Says whether the build was still running during these (it is niced, but shares the CPU).
3. Waits for the build, runs `llama-bench -p 512 -n 128 -ngl 99` (its defaults: flash
   attention auto, 5 repetitions) and `llama-batched-bench -npp 512 -ntg 128 -npl 16 -ngl 99`
   (S_PP and S_TG: the same two B16 numbers), and prints one table of flotilla / llama.cpp
   ratios with the GPU, the date, the device copy bandwidth and the batch-1 limit it implies.
JSON (every number, the commands, the build log's tail on failure) to $OUT/gpu_vs_llamacpp.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp_build  # noqa: E402
from bench.engine_bench import rand_prompts, run  # noqa: E402
from bench.gguf_moe_file import LLAMA3_8B, LlamaShape, write_llama_gguf  # noqa: E402

TARGETS = ["llama-bench", "llama-batched-bench"]
SMOKE = LlamaShape(vocab=1024, hidden=256, layers=2, heads=4, kv_heads=2, inter=512, context=2048)


def gguf_file(path: Path, shape: LlamaShape, device: str) -> tuple[Path, float]:
    """The GGUF at path, written unless a finished one is there (a `.done` marker beside it)."""
    done = path.with_name(path.name + ".done")
    if path.exists() and done.exists():
        return path, 0.0
    path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    tmp = write_llama_gguf(path.with_name(path.name + ".part"), shape, device=device)
    tmp.replace(path)
    done.touch()
    return path, time.perf_counter() - t


def flotilla(path: Path, shape: LlamaShape, device: str, cases: dict[str, int], reps: int,
             build: Any) -> dict[str, Any]:
    from flotilla.libs.common.settings import EngineSettings
    from flotilla.services.engine.engine import Engine
    from flotilla.services.engine.factory import engine_config

    pp, tg, batch = cases["prompt"], cases["gen"], cases["batch"]
    t = time.perf_counter()
    config = dataclasses.replace(engine_config(EngineSettings(), path), kvcache_mem_mib=4096,
                                 max_num_seqs=max(batch, 32))
    engine = Engine(config)
    res: dict[str, Any] = {"load_s": time.perf_counter() - t, "config": {
        k: str(getattr(config, k)) for k in ("resolved_device", "resolved_quantization",
                                             "max_num_batched_tokens", "enforce_eager")}}
    print(f"flotilla engine loaded in {res['load_s']:.0f}s: {res['config']}", flush=True)
    v, busy = shape.vocab, []

    def median(name: str, fn: Any) -> None:
        fn(-1)  # warm-up: compiles, autotunes, captures
        runs = []
        for r in range(reps):
            busy.append(build is not None and build.poll() is None)
            runs.append(fn(r))
        res[name] = {"median": statistics.median(runs), "runs": runs}
        print(f"flotilla {name}: {res[name]['median']:.1f} tok/s  (runs "
              + " ".join(f"{x:.1f}" for x in runs) + ")", flush=True)

    median(f"pp{pp}", lambda r: pp / run(engine, rand_prompts(1, pp, v, 10 + r), 1)[
        "mean_ttft_s"])
    median(f"tg{tg}", lambda r: run(engine, rand_prompts(1, 1, v, 100 + r), tg + 1)[
        "decode_tok_s"])

    def batched(r: int) -> float:
        out = run(engine, rand_prompts(batch, pp, v, 1000 + 100 * r), tg)
        prefill.append(batch * pp / out["last_ttft_s"])
        return out["decode_tok_s"]

    prefill: list[float] = []
    median("b_decode", batched)
    res["b_prefill"] = {"median": statistics.median(prefill[1:]), "runs": prefill[1:]}
    res["build_running_during"] = f"{sum(busy)}/{len(busy)} runs"
    engine.shutdown()
    return res


def _records(text: str) -> list[dict[str, Any]]:
    """The JSON objects a tool printed one a line (llama-bench -o jsonl, batched-bench jsonl)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def llamacpp(bins: dict[str, Path], path: Path, cases: dict[str, int], gpu: bool, threads: int,
             reps: int) -> dict[str, Any]:
    pp, tg, batch = cases["prompt"], cases["gen"], cases["batch"]
    common = ["-ngl", "99"] if gpu else ["-ngl", "0", "-t", str(threads)]
    bench_cmd = [str(bins["llama-bench"]), "-m", str(path), "-p", str(pp), "-n", str(tg),
                 "-r", str(reps), "-o", "jsonl", *common]
    # context: whole 256-token pages for every sequence (llama.cpp pads n_ctx to 256 and splits
    # it evenly among the sequences; a row that does not fit is skipped without a word)
    ctx = batch * -(-(pp + tg) // 256) * 256
    batched_cmd = [str(bins["llama-batched-bench"]), "-m", str(path), "-c", str(ctx), "-b",
                   "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(tg), "-npl", str(batch),
                   "--output-format", "jsonl", *common]
    # batched-bench prints through common_log's worker thread, which sometimes loses its last
    # lines on a pipe at exit (1 run in 3 here): its log file too, and a second try
    log = path.with_name("llama-batched-bench.log")
    batched_cmd += ["--log-file", str(log)]
    res: dict[str, Any] = {"commands": [" ".join(bench_cmd), " ".join(batched_cmd)]}
    for name, cmd in (("llama-bench", bench_cmd), ("llama-batched-bench", batched_cmd)):
        print("$ " + " ".join(cmd), flush=True)
        for _ in range(3):
            log.unlink(missing_ok=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            text = proc.stdout + "\n" + proc.stderr
            records = _records(text + "\n" + (log.read_text() if log.exists() else ""))
            if proc.returncode != 0 or records:
                break
        if proc.returncode != 0 or not records:
            raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{text[-3000:]}")
        res[name] = records
    for r in res["llama-bench"]:
        key = f"pp{pp}" if r["n_prompt"] and not r["n_gen"] else f"tg{tg}"
        res[key] = {"median": r["avg_ts"], "stddev": r["stddev_ts"],
                    "flash_attn": r.get("flash_attn"), "gpu_info": r.get("gpu_info")}
    b = next(r for r in res["llama-batched-bench"] if "speed_tg" in r)
    res["b_prefill"] = {"median": b["speed_pp"]}
    res["b_decode"] = {"median": b["speed_tg"]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the GGUF (written there unless a finished one is; default build/...)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of llama.cpp (--smoke)")
    ap.add_argument("--build-only", action="store_true", help="build and write the GGUF only")
    ap.add_argument("--serial", action="store_true",
                    help="wait for the build before measuring flotilla (no CPU contention)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, CPU build")
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("OUT", ".")) / "gpu_vs_llamacpp.json")
    args = ap.parse_args()
    gpu = not args.smoke
    shape = SMOKE if args.smoke else LLAMA3_8B
    cases = ({"prompt": 64, "gen": 16, "batch": 4} if args.smoke
             else {"prompt": 512, "gen": 128, "batch": 16})
    root = llamacpp_build.ROOT / "build"
    build_dir = root / ("llamacpp-cuda" if gpu else "llamacpp-cpu")
    path = args.gguf or root / ("llama3-8b-q4_k_m.gguf" if gpu else "llama-smoke-q4_k_m.gguf")
    t0 = time.perf_counter()
    proc = llamacpp_build.start_build(build_dir, TARGETS, cuda=gpu, jobs=args.jobs, nice=19)
    print(f"llama.cpp build: {'started' if proc else 'already built'} ({build_dir})", flush=True)
    now = datetime.datetime.now(datetime.UTC)
    res: dict[str, Any] = {"date": now.isoformat(timespec="minutes"),
                           "shape": dataclasses.asdict(shape), "cases": cases,
                           "torch": torch.__version__}
    if gpu:
        from bench.engine_bench import copy_bandwidth, gpu_state

        res.update(gpu=torch.cuda.get_device_name(), gpu_state=gpu_state(),
                   copy_GBps=copy_bandwidth() / 1e9)
    path, res["write_s"] = gguf_file(path, shape, "cuda" if gpu else "cpu")
    res["file_GB"] = path.stat().st_size / 1e9
    print(f"GGUF {path} {res['file_GB']:.2f} GB (written in {res['write_s']:.0f}s)", flush=True)
    try:
        if args.serial or args.build_only:
            bins = llamacpp_build.finish(proc, build_dir, TARGETS)
            proc = None
            res["build_s"] = time.perf_counter() - t0
        if args.build_only:
            print(f"built in {res['build_s']:.0f}s: {', '.join(map(str, bins.values()))}")
            return
        res["flotilla"] = flotilla(path, shape, "cuda" if gpu else "cpu", cases,
                                   args.repetitions, proc)
        gc.collect()  # the engine's GPU memory back before llama.cpp loads
        if gpu:
            torch.cuda.empty_cache()
        args.out.write_text(json.dumps(res, indent=1))
        bins = llamacpp_build.finish(proc, build_dir, TARGETS)
        res.setdefault("build_s", time.perf_counter() - t0)  # at most: waited for here
        res["llama.cpp"] = llamacpp(bins, path, cases, gpu, args.threads, args.repetitions)
    finally:
        args.out.write_text(json.dumps(res, indent=1))
    report(res, shape, cases)


def report(res: dict[str, Any], shape: LlamaShape, cases: dict[str, int]) -> None:
    pp, tg, batch = cases["prompt"], cases["gen"], cases["batch"]
    ours, theirs = res["flotilla"], res["llama.cpp"]
    # bytes a batch-1 decode step reads: the file less the embedding table (one row read)
    embd = shape.vocab * shape.hidden // 256 * 144  # Q4_K: 144 bytes a 256-weight block
    step_bytes = res["file_GB"] * 1e9 - embd
    bw = res.get("copy_GBps")
    limit = f", batch-1 limit {bw * 1e9 / step_bytes:.0f} tok/s" if bw else ""
    print(f"\n{res.get('gpu', 'cpu (smoke)')}  {res['date']}  torch {res['torch']}  "
          f"copy {bw or 0:.0f} GB/s{limit}  file {res['file_GB']:.2f} GB  "
          f"llama.cpp flash_attn {theirs[f'tg{tg}'].get('flash_attn')}  "
          f"build running during flotilla: {ours['build_running_during']}")
    print(f"{'case':<28}{'flotilla':>10}{'llama.cpp':>11}{'ratio':>8}")
    rows = ((f"pp{pp} (batch 1, prompt tok/s)", f"pp{pp}"),
            (f"tg{tg} (batch 1, tok/s)", f"tg{tg}"),
            (f"B{batch} prefill ({batch}x{pp}, tok/s)", "b_prefill"),
            (f"B{batch} decode ({batch}x{tg}, tok/s)", "b_decode"))
    for label, key in rows:
        a, b = ours[key]["median"], theirs[key]["median"]
        print(f"{label:<28}{a:>10.1f}{b:>11.1f}{a / b:>7.2f}x")


if __name__ == "__main__":
    main()
