"""GPU check of the GGUF kernels at real sizes: every quantized type's GEMV / GEMM against a
dequantize-then-matmul reference, and the GGUF fused MoE at the Qwen3-30B-A3B shape against the
torch MoE over dequantized experts; with timings (bandwidth for decode, bf16 fused MoE beside).

    python bench/gguf_gpu_check.py [--out FILE]
    python bench/gguf_gpu_check.py --smoke      # CPU interpreter, tiny sizes (script check)

Weights: our quantizer (services/engine/quant/gguf_quantize.py) for the legacy and K-quant
types; random block bytes with a small f16 d for the i-quants (every code, sign and scale
pattern). Errors are ||ours - ref|| / ||ref|| in float64 (bf16 activations: ~1e-2 expected,
a layout bug gives ~1). Exit status 1 if any error exceeds 5e-2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flotilla.kernels.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from flotilla.kernels.gguf_dequant import GGUF_TYPES, IQ4_XS, Q4_K, Q6_K, dequantize_ref  # noqa: E402
from flotilla.kernels.gguf_iq import IQ_GRID_TYPES  # noqa: E402
from flotilla.kernels.gguf_matmul import gguf_matmul_triton  # noqa: E402
from flotilla.kernels.gguf_moe import QuantPart, dequantize_parts, fused_moe_gguf_triton  # noqa: E402
from flotilla.services.engine.quant.gguf_quantize import quantize_gguf  # noqa: E402

LIMIT = 5e-2
_IQ4_NL = 20


def blocks(n: int, k: int, qtype: int, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    t = GGUF_TYPES[qtype]
    if qtype in IQ_GRID_TYPES or qtype in (IQ4_XS, _IQ4_NL):
        raw = torch.randint(0, 256, (n, k // t.qk, t.type_size), dtype=torch.uint8,
                            generator=gen, device=device)
        d = (torch.rand(n, k // t.qk, generator=gen, device=device) * 0.004 + 0.001)
        raw[:, :, :2] = d.to(torch.float16).view(torch.uint8).reshape(n, k // t.qk, 2)
        return raw.reshape(n, -1)
    return quantize_gguf(torch.randn(n, k, generator=gen, device=device) * 0.02, qtype)


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


def timed(fn: Callable[[], Any], iters: int) -> float:
    """Median seconds per call."""
    fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return sorted(times)[len(times) // 2]


def check_matmuls(device: str, n: int, k: int, rows: list[int], iters: int) -> list[dict]:
    out = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for qtype, t in sorted(GGUF_TYPES.items()):
        w = blocks(n, k, qtype, device, qtype)
        dense = dequantize_ref(w, qtype)
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = F.linear(x.double(), dense.double())
            err = rel(gguf_matmul_triton(x, w, qtype), ref)
            sec = timed(partial(gguf_matmul_triton, x, w, qtype), iters)
            out.append({"type": t.name, "M": m, "N": n, "K": k, "rel_err": err, "us": sec * 1e6,
                        "weight_GBps": w.numel() / sec / 1e9})
            print(f"{t.name:<8} M={m:<4} err {err:.1e}  {sec * 1e6:9.1f} us  "
                  f"{w.numel() / sec / 1e9:7.1f} GB/s of blocks", flush=True)
    return out


def check_moe(device: str, e: int, h: int, inter: int, top_k: int, tokens: list[int],
              iters: int) -> list[dict]:
    out = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for gate_up_t, down_t in ((Q4_K, Q6_K), (IQ4_XS, IQ4_XS)):
        w13 = [QuantPart(blocks(e * 2 * inter, h, gate_up_t, device, 1).reshape(e, 2 * inter, -1),
                         gate_up_t)]
        w2 = [QuantPart(blocks(e * h, inter, down_t, device, 2).reshape(e, h, -1), down_t)]
        d13, d2 = dequantize_parts(w13, dtype), dequantize_parts(w2, dtype)
        for t in tokens:
            gen = torch.Generator(device=device).manual_seed(t)
            x = torch.randn(t, h, device=device, dtype=dtype, generator=gen)
            logits = torch.randn(t, e, device=device, generator=gen)
            weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            ref = fused_moe_ref(x.double(), d13.double(), d2.double(), weights.double(), ids)
            err = rel(fused_moe_gguf_triton(x, w13, w2, weights, ids), ref)
            sec = timed(partial(fused_moe_gguf_triton, x, w13, w2, weights, ids), iters)
            sec_bf16 = timed(partial(fused_moe_triton, x, d13, d2, weights, ids), iters)
            name = f"{GGUF_TYPES[gate_up_t].name}/{GGUF_TYPES[down_t].name}"
            out.append({"types": name, "tokens": t, "rel_err": err, "us": sec * 1e6,
                        "float_us": sec_bf16 * 1e6})
            print(f"MoE {name:<14} T={t:<4} err {err:.1e}  {sec * 1e6:9.1f} us  (float experts "
                  f"{sec_bf16 * 1e6:9.1f} us)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/gguf_gpu_check.json")
    args = ap.parse_args()
    res: dict[str, Any]
    if args.smoke:
        res = {"matmul": check_matmuls("cpu", 32, 256, [1, 3], 1),
               "moe": check_moe("cpu", 4, 256, 256, 2, [1, 3], 1)}
    else:
        res = {"gpu": torch.cuda.get_device_name(),
               "matmul": check_matmuls("cuda", 4096, 4096, [1, 16, 512], 50),
               "moe": check_moe("cuda", 128, 2048, 768, 8, [1, 16, 512], 20)}
    Path(args.out).write_text(json.dumps(res, indent=2))
    worst = max(r["rel_err"] for part in ("matmul", "moe") for r in res[part])
    print(f"worst rel. error {worst:.2e} (limit {LIMIT})")
    sys.exit(0 if worst < LIMIT else 1)


if __name__ == "__main__":
    main()
