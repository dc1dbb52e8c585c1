"""Decode GEMV sweep: Llama-3-8B's four decode matrices x M in {1, 16} x every weight format.

Per (matrix, M): cuBLAS bf16 (F.linear), our bf16 GEMV (kernels/gemv.py, autotuned), GPTQ/AWQ
w4a16 (group 128), GGUF Q4_K and fp8 per-channel, each timed as CUDA-graph replays
(triton.testing.do_bench_cudagraph) after an eager warm-up call (compile + autotune); one replay
walks through enough distinct weight copies (like a model's layers) that they come from HBM.
Bandwidth = bytes of weights read / time, as % of the device-to-device copy bandwidth measured
first (bytes read + written, as docs/benchmarks.md). Extra row: the down projection reading
SiLU*mul of gate_up inside the GEMV vs silu_and_mul + cuBLAS.

    python bench/gemv_sweep.py             # GPU; JSON to $OUT/gemv_sweep.json (or --out)
    python bench/gemv_sweep.py --smoke     # CPU, Triton interpreter, tiny shapes: checks the script
    python bench/gemv_sweep.py --formats fp8,fp8g128 --m 1,2   # the fp8 decode GEMV alone
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:  # before triton's first import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import copy_bandwidth  # noqa: E402

MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}
SMOKE_MATRICES = {"qkv": (48, 256), "o": (32, 256), "gate_up": (64, 256), "down": (32, 512)}
FORMATS = ("cublas", "gemv", "w4a16", "q4k", "fp8")
GROUP = 128


def copies_needed(nbytes: int, cuda: bool) -> int:
    """Distinct weight copies one timed call walks through (as a model's layers do), so that
    replays read HBM, not the L2 (50 MB on an H100/H200 holds all of q/k/v or o)."""
    if not cuda:
        return 1
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(64, -(-8 * l2 // nbytes)))


def time_ms(fn: Callable[[], object], cuda: bool) -> float:
    fn()  # compile, autotune: never inside the graph capture
    if not cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=20))


def build(fmt: str, n: int, k: int, device: str) -> tuple[Callable[[torch.Tensor], object], int]:
    """(x -> y, bytes of weights read per call) of one format on random weights."""
    from flotilla.kernels.fp8 import fp8_matmul_triton, quantize_fp8_per_channel
    from flotilla.kernels.gemv import gemv_triton
    from flotilla.kernels.gguf_dequant import Q4_K, Q5_K, gguf_type
    from flotilla.kernels.gguf_matmul import gguf_matmul_triton
    from flotilla.kernels.w4a16 import w4a16_matmul_triton

    if fmt in ("cublas", "gemv"):
        w = torch.randn(n, k, dtype=torch.bfloat16, device=device) / k ** 0.5
        if fmt == "cublas":
            return (lambda x: F.linear(x, w)), w.numel() * 2
        return (lambda x: gemv_triton(x, w)), w.numel() * 2
    if fmt == "w4a16":
        q = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device=device)
        s = (torch.rand(n, k // GROUP, device=device) * 0.01).half()
        z = torch.full((n, k // GROUP), 8, dtype=torch.uint8, device=device)
        return ((lambda x: w4a16_matmul_triton(x, q, s, z, GROUP)),
                q.numel() * 4 + s.numel() * 2 + z.numel())
    if fmt in ("q4k", "q5k"):  # q5k: opt-in
        qtype = Q4_K if fmt == "q4k" else Q5_K
        t = gguf_type(qtype)
        blocks = torch.randint(0, 256, (n, k // 256, t.type_size), dtype=torch.uint8,
                               device=device)
        blocks[..., :4] = torch.tensor([0, 0x20, 0, 0x20], dtype=torch.uint8)  # d, dmin: small
        qw = blocks.reshape(n, -1)
        return (lambda x: gguf_matmul_triton(x, qw, qtype)), qw.numel()
    if fmt in ("fp8", "fp8g128", "fp8mma"):  # per-channel / group-128 scales (fp8g128:
        # opt-in); fp8mma: the tensor-core GEMV (kernels/fp8_gemv.py) instead of the default
        w8, scale = quantize_fp8_per_channel(torch.randn(n, k, device=device))
        if fmt == "fp8g128":
            scale = scale.repeat(1, k // GROUP) * (1 + torch.rand(n, k // GROUP, device=device))
        if fmt == "fp8mma":
            from flotilla.kernels.fp8_gemv import fp8_gemv_mma

            return (lambda x: fp8_gemv_mma(x, w8, scale, k)), w8.numel() + scale.numel() * 4
        return (lambda x: fp8_matmul_triton(x, w8, scale)), w8.numel() + scale.numel() * 4
    raise ValueError(fmt)


def best_config(fmt: str, m: int) -> str | None:
    if fmt in ("gemv", "gemv(silu)"):
        from flotilla.kernels.gemv import _gemv_tuned
    elif fmt == "fp8mma" and m <= 2:  # the tensor-core fp8 GEMV
        from flotilla.kernels.fp8_gemv import _gemv_tuned
    elif fmt in ("fp8", "fp8g128"):  # the CUDA-core fp8 GEMV (FLOTILLA_FP8_GEMV=fma)
        from flotilla.kernels.fp8_gemv_fma import _tuned as _gemv_tuned
    elif fmt == "w4a16" and m == 1:  # the CUDA-core w4a16 GEMV
        from flotilla.kernels.w4a16_gemv import _tuned as _gemv_tuned
    elif fmt in ("q4k", "q5k") and m <= 2:  # kernels/gguf_kquant_gemv.py
        from flotilla.kernels import gguf_kquant_gemv

        _gemv_tuned = gguf_kquant_gemv._tuned_q4 if fmt == "q4k" else gguf_kquant_gemv._tuned_q5
    else:
        return None
    c = getattr(_gemv_tuned, "best_config", None)
    return None if c is None else f"{c.kwargs} w{c.num_warps} s{c.num_stages}"


def sweep(matrices: dict[str, tuple[int, int]], ms: list[int], formats: list[str], cuda: bool,
          copy_gbps: float) -> list[dict]:
    device = "cuda" if cuda else "cpu"
    rows = []
    for name, (n, k) in matrices.items():
        for fmt in formats:
            fn, nbytes = build(fmt, n, k, device)
            fns = [fn] + [build(fmt, n, k, device)[0]
                          for _ in range(copies_needed(nbytes, cuda) - 1)]
            for m in ms:
                if fmt == "gemv" and m > 16:
                    continue
                x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
                t = time_ms(functools.partial(_each, fns, x), cuda) / len(fns)
                gbps = nbytes / (t * 1e-3) / 1e9
                rows.append(dict(matrix=name, n=n, k=k, m=m, format=fmt, us=t * 1e3,
                                 weight_bytes=nbytes, gbps=gbps, pct_copy=100 * gbps / copy_gbps,
                                 config=best_config(fmt, m)))
            del fn, fns
    return rows


def _each(fns: list[Callable[[torch.Tensor], object]], x: torch.Tensor) -> None:
    for fn in fns:
        fn(x)


def fused_down(n: int, k: int, ms: list[int], cuda: bool, copy_gbps: float) -> list[dict]:
    """down(silu(gate) * up): fused GEMV vs silu_and_mul + cuBLAS."""
    from flotilla.kernels.activation import silu_and_mul_triton
    from flotilla.kernels.gemv import gemv_triton

    device = "cuda" if cuda else "cpu"
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=device) / k ** 0.5
          for _ in range(copies_needed(n * k * 2, cuda))]
    w = ws[0]
    rows = []
    for m in ms:
        gu = torch.randn(m, 2 * k, dtype=torch.bfloat16, device=device)
        def separate(gu: torch.Tensor) -> None:
            for w in ws:
                F.linear(silu_and_mul_triton(gu), w)

        def fused(gu: torch.Tensor) -> None:
            for w in ws:
                gemv_triton(gu, w, silu_mul=True)

        for fmt, f in (("silu+cublas", separate), ("gemv(silu)", fused)):
            fn = functools.partial(f, gu)
            t = time_ms(fn, cuda) / len(ws)
            gbps = w.numel() * 2 / (t * 1e-3) / 1e9
            rows.append(dict(matrix="down+silu", n=n, k=k, m=m, format=fmt, us=t * 1e3,
                             weight_bytes=w.numel() * 2, gbps=gbps,
                             pct_copy=100 * gbps / copy_gbps, config=best_config(fmt, m)))
    return rows


def print_table(rows: list[dict]) -> None:
    cols = list(dict.fromkeys(r["format"] for r in rows))
    keys = list(dict.fromkeys((r["matrix"], r["m"]) for r in rows))
    print(f"{'matrix':<10}{'M':>3} " + "".join(f"{c:>20}" for c in cols))
    for matrix, m in keys:
        cells = []
        for c in cols:
            r = next((r for r in rows if (r["matrix"], r["m"], r["format"]) == (matrix, m, c)),
                     None)
            cells.append(f"{r['us']:>9.1f}us {r['pct_copy']:>5.0f}%" if r else " " * 20)
        print(f"{matrix:<10}{m:>3} " + "".join(f"{c:>20}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--m", default="1,16", help="batch sizes (rows of x)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gemv_sweep.json)")
    args = ap.parse_args()
    if args.smoke:
        from tests.kernels import interpreter_fixes

        interpreter_fixes.apply()
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke")
    ms = [int(v) for v in args.m.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    start = time.perf_counter()
    copy_gbps = copy_bandwidth() / 1e9 if cuda else 1.0
    matrices = SMOKE_MATRICES if args.smoke else MATRICES
    rows = sweep(matrices, ms, formats, cuda, copy_gbps)
    n, k = matrices["down"]
    rows += fused_down(n, k, ms, cuda, copy_gbps)
    device = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    print(f"{device}: copy {copy_gbps:.0f} GB/s; us and % of copy bandwidth (weight bytes / time)")
    print_table(rows)
    for r in rows:
        if r["config"]:
            print(f"  {r['format']} {r['matrix']} M={r['m']}: {r['config']}")
    wall = time.perf_counter() - start
    print(f"wall {wall:.1f} s")
    out = args.out or (os.path.join(os.environ["OUT"], "gemv_sweep.json")
                       if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(dict(device=device, copy_gbps=copy_gbps, wall_s=wall,
                                             torch=torch.__version__, rows=rows), indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
