"""Quantized-weight decode benchmarks on a Llama-3-8B-shaped model (issue 6).

Formats, each an engine built from random weights quantized by our own code (bench/engine_bench.py's
dummy model directory, load_format="dummy"):
  bf16  the unquantized engine (reference, same run)
  q4k   --isq q4k (GGUF Q4_K blocks, kernels/gguf_*.py)
  gptq  4-bit, group 128, symmetric (kernels/w4a16.py); codes randomized after loading
  awq   4-bit, group 128, zero points (same kernel; random zeros)
  gptq / awq  in the default K-order layout (kernels/w4a16.py GEMV, w4a16_mma.py for 2-64 rows)
  gptq-marlin / awq-marlin  the load-time re-packed layout instead (kernels/w4a16_marlin.py)
  gptq-both / awq-both  both copies (FLOTILLA_W4_LAYOUT=both): the A/B of issue 26
  fp8   --isq fp8 (e4m3, per-channel scales, kernels/fp8.py)
Measured per format:
  B1   batch-1 decode tok/s (128 prompt tokens, 256 generated)
  B16  16 requests x 128 in / 128 out, output tok/s
  GEMV the M=1 matmul of each projection shape, cycling over all layers inside a CUDA graph (weights
       stream from HBM, not L2): weight bytes / time, as % of the measured device copy bandwidth.
Targets on H100 (batch 1): q4k >= 300 tok/s, gptq/awq >= 350, fp8 >= 280.

    python bench/quant_bench.py [--only q4k,gptq,fp8,bf16,awq] [--layers 32] [--repeat N]
                                [--out FILE]
Environment: the kernel switches of EngineSettings (FLOTILLA_PDL=0|1, ...; kernels/selection.py).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import LLAMA3_8B, copy_bandwidth, model_dir, rand_prompts, run  # noqa: E402
from flotilla.libs.common.settings import EngineSettings  # noqa: E402
from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.factory import kernel_selection  # noqa: E402

TARGETS = {"q4k": 300, "gptq": 350, "awq": 350, "fp8": 280}
FORMATS = {  # name -> (EngineConfig quantization, isq)
    "q4k": (None, "q4k"), "gptq": ("gptq", None), "fp8": (None, "fp8"), "bf16": (None, None),
    "awq": ("awq", None), "gptq-marlin": ("gptq", None), "awq-marlin": ("awq", None),
    "gptq-both": ("gptq", None), "awq-both": ("awq", None),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def randomize_w4(model: torch.nn.Module, zero_points: bool) -> None:
    """Dummy GPTQ/AWQ layers start from uninitialised codes: give them random ones."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for module in model.modules():
        q = getattr(module, "w4_qweight", None)
        if q is None:
            continue
        for words in (q, getattr(module, "w4_marlin", None)):
            if words is not None:
                words.copy_(torch.randint(-2**31, 2**31 - 1, words.shape, generator=g,
                                          device="cuda", dtype=torch.int64).to(torch.int32))
        z = module.w4_zeros
        if zero_points:
            z.copy_(torch.randint(4, 12, z.shape, generator=g, device="cuda", dtype=torch.uint8))
        else:
            z.fill_(8)
        module.w4_scales.copy_(torch.rand(module.w4_scales.shape, generator=g,
                                          device="cuda").half() * 0.004)


def weight_bytes_of(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for name, b in module.named_buffers()
               if name in ("qweight", "w4_qweight", "w4_marlin", "w4_scales", "w4_zeros",
                           "weight_fp8", "weight_scale")) or sum(
        p.numel() * p.element_size() for p in module.parameters(recurse=False) if p.dim() == 2)


def gemv_bandwidth(model: torch.nn.Module, copy_gbps: float, dtype: torch.dtype) -> dict:
    """Per projection: time of one M=1 matmul (mean over all layers, replayed in a CUDA graph)."""
    layers = model.model.layers
    out = {}
    for proj in PROJECTIONS:
        mods = [getattr(layer.self_attn if "qkv" in proj or "o_proj" in proj else layer.mlp, proj)
                for layer in layers]
        k = mods[0].input_size
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        for m in mods:  # compile / warm up
            m(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for m in mods:
                m(x)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        reps = 20
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_call = start.elapsed_time(end) / 1e3 / reps / len(mods)
        nbytes = weight_bytes_of(mods[0])
        gbps = nbytes / per_call / 1e9
        out[proj] = {"us": per_call * 1e6, "bytes": nbytes, "GBps": gbps,
                     "pct_copy": gbps / copy_gbps}
    return out


def tuned_picks() -> dict[str, dict[str, str]]:
    """The decode GEMVs' autotuned tiles so far in this process ({kernel: {key: config}})."""
    from flotilla.kernels import (
        fp8_gemv_fma,
        gemv,
        gguf_kquant_gemv,
        w4a16_gemv,
        w4a16_marlin,
        w4a16_mma,
    )

    tuners = {"w4a16": w4a16_gemv._tuned, "w4a16_perm": w4a16_gemv._tuned_perm,
              "w4a16_repacked": w4a16_gemv._TUNED[False, True], "w4_mma": w4a16_mma._tuned,
              "w4_marlin": w4a16_marlin._tuned,
              "q4k": gguf_kquant_gemv._tuned_q4, "fp8_fma": fp8_gemv_fma._tuned,
              "bf16": gemv._gemv_tuned}
    return {name: {str(key): str(config) for key, config in t.cache.items()}
            for name, t in tuners.items() if t.cache}


def bench_format(name: str, layers: int, copy_gbps: float, repeat: int = 1) -> dict:
    quantization, isq = FORMATS[name]
    t = time.perf_counter()
    suffix = name.rsplit("-", 1)[-1]  # gptq-marlin / gptq-both: the selection's w4_layout
    layout = suffix if suffix in ("marlin", "both") else "kmajor"
    engine = Engine(EngineConfig(model=model_dir(layers), load_format="dummy", dtype="bfloat16",
                                 device="cuda", quantization=quantization, isq=isq,
                                 kvcache_mem_mib=4096, max_num_seqs=32,
                                 max_num_batched_tokens=4096,
                                 kernel_selection=kernel_selection(
                                     EngineSettings(w4_layout=layout))))
    model = engine.runner.model
    if quantization in ("gptq", "awq"):
        randomize_w4(model, zero_points=quantization == "awq")
    res: dict = {"startup_s": time.perf_counter() - t,
                 "weights_GB": sum(weight_bytes_of(m) for m in model.modules()
                                   if hasattr(m, "quant_method")) / 1e9}
    vocab = LLAMA3_8B["vocab_size"]
    run(engine, rand_prompts(2, 64, vocab, 0), 8)  # warm-up
    runs = [run(engine, rand_prompts(1, 128, vocab, 1), 256) for _ in range(repeat)]
    res["B1"] = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]  # the median
    res["B1"]["runs_decode_tok_s"] = [r["decode_tok_s"] for r in runs]
    res["B16"] = run(engine, rand_prompts(16, 128, vocab, 2), 128)
    res["gemv"] = gemv_bandwidth(model, copy_gbps, torch.bfloat16)
    res["tuned"] = tuned_picks()
    engine.shutdown()
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(FORMATS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/quant_bench.json")
    ap.add_argument("--repeat", type=int, default=1, help="B1 runs (the median is reported)")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth() / 1e9
    res: dict = {"gpu": gpu, "date": datetime.date.today().isoformat(), "layers": args.layers,
                 "torch": torch.__version__, "copy_GBps": copy_gbps, "formats": {}}
    for name in args.only.split(","):
        try:
            res["formats"][name] = bench_format(name, args.layers, copy_gbps, args.repeat)
        except Exception as exc:  # keep the other formats' numbers
            res["formats"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{gpu}  {res['date']}  torch {torch.__version__}  layers {args.layers}  "
          f"copy {copy_gbps:.0f} GB/s")
    print(f"{'format':10s} {'GB':>6s} {'B1 tok/s':>9s} {'target':>7s} {'B16 tok/s':>10s}  "
          f"GEMV % of copy BW ({', '.join(PROJECTIONS)})")
    for name, r in res["formats"].items():
        if "error" in r:
            print(f"{name:10s} error: {r['error'][:100]}")
            continue
        gemv = " ".join(f"{v['pct_copy']:.0%}({v['us']:.0f}us)" for v in r["gemv"].values())
        target = TARGETS.get(name)
        runs = "/".join(f"{v:.0f}" for v in r["B1"].get("runs_decode_tok_s", []))
        print(f"{name:10s} {r['weights_GB']:6.2f} {r['B1']['decode_tok_s']:9.1f} "
              f"{(str(target) if target else '-'):>7s} {r['B16']['output_tok_s']:10.1f}  {gemv}"
              f"  B1 runs {runs}")


if __name__ == "__main__":
    main()
