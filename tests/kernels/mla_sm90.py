"""Compile the MLA kernels (kernels/mla_attention.py) for sm_90 with their default tiles at
DeepSeek-V3 sizes (kv_lora_rank 512, rope 64, bf16); report register spills.

Run as `python -m tests.kernels.mla_sm90` without TRITON_INTERPRET; prints one JSON object
{config: spill bytes}. Needs no GPU. Used by test_mla_attention.py.
"""

from __future__ import annotations

import json
import os
import sys

import flotilla.kernels.mla_attention  # noqa: F401  (registers the module for compile_sm90)
from tests.kernels.sm90_compile import compile_sm90, spill_bytes

TYPES = {n: "*bf16" for n in ("q_lat_ptr", "q_pe_ptr", "cache_ptr", "out_ptr")}
TYPES |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
TYPES |= {"qk_scale": "fp32", "lse_ptr": "*fp32"}
SIZES = dict(RANK=512, ROPE=64, BLOCK_SIZE=16, BLOCK_R=512, BLOCK_P=64, DOT_PRECISION="tf32")


def spill_report() -> dict[str, int]:
    report = {}
    for num_splits in (1, 8):
        types = TYPES | ({"out_ptr": "*fp32"} if num_splits > 1 else {})
        constexprs = dict(SIZES, BLOCK_H=16, BLOCK_N=32, NUM_SPLITS=num_splits)
        report[f"mla decode splits={num_splits}"] = spill_bytes(
            compile_sm90("mla_attention", "_mla_decode_kernel", types, constexprs, 8))
    constexprs = dict(SIZES, BLOCK_H=16, BLOCK_T=2, BLOCK_N=32)
    report["mla extend"] = spill_bytes(
        compile_sm90("mla_attention", "_mla_extend_kernel", TYPES, constexprs, 8))
    return report


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the JIT compiler")
    print(json.dumps(spill_report()))
