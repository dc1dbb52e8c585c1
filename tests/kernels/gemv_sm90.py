"""Compile the small-batch GEMV (kernels/gemv.py) for sm_90 with every autotune config and M
bucket it may pick; report register spills.

Run as `python -m tests.kernels.gemv_sm90` without TRITON_INTERPRET; prints one JSON object
{config: spill bytes}. Needs no GPU. Used by test_gemv.py.
"""

from __future__ import annotations

import json
import os
import sys

from flotilla.kernels.gemv import CONFIGS, _prune
from tests.kernels.sm90_compile import compile_sm90, spill_bytes

TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}


def spill_report(buckets: tuple[int, ...] = (1, 2, 8, 16)) -> dict[str, int]:
    report = {}
    for bm in buckets:
        for c in _prune(CONFIGS, {}, BLOCK_M=bm):
            # at M = 1 also SiLU·mul read as x, and stored from [gate; up] rows (gated)
            variants = ((False, False), (True, False), (False, True)) if bm == 1 else \
                ((False, False),)
            for silu, gated in variants:
                if gated and c.kwargs["BLOCK_N"] < 2:
                    continue
                constexprs = dict(BLOCK_M=bm, SILU_MUL=silu, GATED=gated, EVEN_K=True,
                                  **c.kwargs)
                name = " ".join(f"{k}={v}" for k, v in constexprs.items()) + \
                    f" warps={c.num_warps} stages={c.num_stages}"
                report[name] = spill_bytes(compile_sm90("gemv", "_gemv_kernel", TYPES,
                                                        constexprs, c.num_warps, c.num_stages))
    return report


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the JIT compiler")
    print(json.dumps(spill_report()))
