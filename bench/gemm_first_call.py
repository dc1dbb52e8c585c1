"""Host time of a bf16 GEMM the first time a row count M is seen, against the same call again.

    python bench/gemm_first_call.py [--blas cublas|cublaslt]

A prefill step's row count is its token count, which changes from step to step. If the BLAS
library spends milliseconds on the host for an M it has not seen (kernel selection, lazy
module loading), an eager prefill pays it once per weight shape per new M. Prints, per weight
shape (Llama-3-8B) and M, the host time of the first and second call (launch only, the GPU
idle before each) and writes JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = [512, 513, 640, 1408, 1409, 2304, 2350, 4001, 6784, 6795]


def host_ms(x: torch.Tensor, w: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.nn.functional.linear(x, w)
    dt = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blas", default=None, choices=("cublas", "cublaslt"))
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/gemm_first_call.json")
    args = ap.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    dev = torch.device("cuda")
    weights = {n: torch.randn(nout, k, device=dev, dtype=torch.bfloat16)
               for n, (k, nout) in SHAPES.items()}
    warm = torch.randn(64, 14336, device=dev, dtype=torch.bfloat16)
    for w in weights.values():  # a first call per weight (library start-up)
        torch.nn.functional.linear(warm[:, :w.shape[1]], w)
    rows = []
    print(f"blas={torch.backends.cuda.preferred_blas_library()}  "
          f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')}")
    print(f"{'M':>6} " + " ".join(f"{n + ' 1st/2nd':>18}" for n in SHAPES) + "  (host ms)")
    for m in ROWS:
        cells, row = [], {"M": m}
        for n, w in weights.items():
            x = torch.randn(m, w.shape[1], device=dev, dtype=torch.bfloat16)
            a, b = host_ms(x, w), host_ms(x, w)
            row[n] = [round(a, 3), round(b, 3)]
            cells.append(f"{a:8.2f} /{b:7.2f}")
        rows.append(row)
        print(f"{m:>6} " + " ".join(f"{c:>18}" for c in cells), flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                          "blas": str(torch.backends.cuda.preferred_blas_library()),
                                          "module_loading": os.environ.get("CUDA_MODULE_LOADING"),
                                          "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
