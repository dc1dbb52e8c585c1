"""4-bit batched decode GEMMs against bf16 and the copy bandwidth (issue 26), on a GPU.

For each Llama-3-8B projection (qkv, o, gate_up, down) and each row count M, in one run:
  bf16    torch's F.linear on the bf16 weight (cuBLAS), the peer
  mma     kernels/w4a16_mma.py over the K-order layout (autotuned), what served 2-64 rows before
  marlin  kernels/w4a16_marlin.py over the same codes re-packed at load (autotuned; tile printed)
  gemv    the M=1 GEMV over the K-order layout / gemv_m the same GEMV over the re-packed one
Weights cycle over 8 copies (> L2) so every call streams them from HBM. Each kernel's time is
also given as the copy-bandwidth floor for its weight bytes divided by its time (% of copy).
The table's last rows sum the four projections: a layer's matmul time, and the ratio bf16 / 4-bit.

    python bench/w4a16_batched.py [--m 1,2,8,16,32,64] [--out FILE] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flotilla.kernels.w4a16 import unpack_int4, w4a16_dequantize_ref, w4a16_matmul_triton  # noqa: E402
from flotilla.kernels.w4a16_marlin import MARLIN_CONFIGS, marlin_pack, w4a16_marlin  # noqa: E402
from flotilla.kernels.w4a16_marlin import _tuned as _marlin_tuned  # noqa: E402
from flotilla.kernels.w4a16_mma import w4a16_mma  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
COPIES = 8
SWEEP = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in MARLIN_CONFIGS]


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time_fn(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() / t


def time_fn(fn, reps: int = 50) -> float:  # noqa: ANN001
    """Seconds a call, CUDA events around `reps` calls after warm-up (host-bound for small
    kernels: the copy only)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def graph_time(fns: list, rounds: int = 4, replays: int = 10) -> float:  # noqa: ANN001
    """Seconds a call: every fn run eagerly (autotuning, split-K counters), then `rounds`
    passes over them captured in one CUDA graph (no launch overhead, weights from HBM: the
    copies together exceed L2) and the graph replayed."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * rounds * len(fns))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,2,8,16,32,64")
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of pinned tiles")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{dev}, {datetime.date.today()}, copy bandwidth {bw / 1e9:.0f} GB/s, group {GROUP}")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    worst = 0.0
    for name, (n, k) in SHAPES.items():
        qs = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, device="cuda",
                            dtype=torch.int64).to(torch.int32) for _ in range(COPIES)]
        ss = [(torch.rand(n, k // GROUP, generator=g, device="cuda") * 0.01 + 1e-3).half()
              for _ in range(COPIES)]
        zs = [torch.randint(0, 16, (n, k // GROUP), generator=g, device="cuda",
                            dtype=torch.int32).to(torch.uint8) for _ in range(COPIES)]
        ws = [w4a16_dequantize_ref(qs[i], ss[i], zs[i], GROUP).to(torch.bfloat16)
              for i in range(COPIES)]
        ms_ = [marlin_pack(unpack_int4(q)) for q in qs]  # the same codes, re-packed
        q4_bytes = n * k // 2 + 3 * n * (k // GROUP)
        for m in ms:
            x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            row: dict = {"shape": name, "N": n, "K": k, "M": m}
            row["bf16"] = graph_time([functools.partial(F.linear, x, ws[i]) for i in range(COPIES)])
            if m == 1:
                row["gemv"] = graph_time([functools.partial(
                    w4a16_matmul_triton, x, qs[i], ss[i], zs[i], GROUP) for i in range(COPIES)])
                row["gemv_m"] = graph_time([functools.partial(
                    w4a16_matmul_triton, x, ms_[i], ss[i], zs[i], GROUP, marlin=True)
                    for i in range(COPIES)])
            else:
                for key, fn, q in (("mma", w4a16_mma, qs), ("marlin", w4a16_marlin, ms_)):
                    out = fn(x, q[0], ss[0], zs[0], GROUP, None)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    worst = max(worst, err)
                    row[f"{key}_err"] = err
                    row[key] = graph_time([functools.partial(fn, x, q[i], ss[i], zs[i], GROUP,
                                                             None) for i in range(COPIES)])
                if args.sweep and m == 16:
                    sweep = []
                    for cfg in SWEEP:
                        try:
                            t = graph_time([functools.partial(
                                w4a16_marlin, x, ms_[i], ss[i], zs[i], GROUP, None, config=cfg)
                                for i in range(COPIES)], rounds=2, replays=5)
                        except Exception as e:  # noqa: BLE001 (a tile that does not compile)
                            print(f"  {name} M={m} {cfg}: {type(e).__name__}")
                            continue
                        sweep.append((t, cfg))
                    sweep.sort(key=lambda v: v[0])
                    for t, cfg in sweep[:4]:
                        print(f"  sweep {name} M={m}: {t * 1e6:6.1f} us "
                              f"({100 * q4_bytes / bw / t:.0f}% copy) {cfg}")
                    row["sweep_best"] = [sweep[0][0], sweep[0][1]] if sweep else None
                best = _marlin_tuned.cache.get(next((key for key in _marlin_tuned.cache
                                                     if key[0] == n and key[1] == k
                                                     and key[2] == m), None))
                row["marlin_config"] = str(best)
            row["floor_4bit"] = q4_bytes / bw
            row["floor_bf16"] = 2 * n * k / bw
            rows.append(row)
    print(f"{'shape':8} {'M':>3} {'bf16 us':>8} {'mma us':>8} {'%copy':>6} {'new us':>8} "
          f"{'%copy':>6} {'bf16/new':>8} {'mma/new':>8}  tile (M=1: the GEMV, K-order / "
          "re-packed)")
    for r in rows:
        old_t, new_t = r.get("mma", r.get("gemv")), r.get("marlin", r.get("gemv_m"))
        print(f"{r['shape']:8} {r['M']:>3} {r['bf16'] * 1e6:8.1f} {old_t * 1e6:8.1f} "
              f"{100 * r['floor_4bit'] / old_t:5.0f}% {new_t * 1e6:8.1f} "
              f"{100 * r['floor_4bit'] / new_t:5.0f}% {r['bf16'] / new_t:7.2f}x "
              f"{old_t / new_t:7.2f}x  {r.get('marlin_config', '')}")
    print("layer (4 projections summed):")
    for m in ms:
        sel = [r for r in rows if r["M"] == m]
        b = sum(r["bf16"] for r in sel)
        old_t = sum(r.get("mma", r.get("gemv")) for r in sel)
        new_t = sum(r.get("marlin", r.get("gemv_m")) for r in sel)
        floor = sum(r["floor_4bit"] for r in sel)
        print(f"  M={m:>2}: bf16 {b * 1e6:7.1f} us | current {old_t * 1e6:7.1f} us "
              f"({b / old_t:.2f}x bf16, {100 * floor / old_t:.0f}% of copy) | re-packed "
              f"{new_t * 1e6:7.1f} us ({b / new_t:.2f}x bf16, {100 * floor / new_t:.0f}% of copy)")
    print(f"worst relative error of the 4-bit GEMMs vs the bf16-weight fp32 product: {worst:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": dev, "date": str(datetime.date.today()),
                                              "copy_GBps": bw / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
