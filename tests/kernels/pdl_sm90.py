"""Where the PDL wait lands in the sm_90a SASS of the decode kernels (kernels/pdl.py).

Run as `python -m tests.kernels.pdl_sm90` without TRITON_INTERPRET; prints one JSON object
{kernel: {"acqbulk": [indices], "ldg": [indices], "ops": count}} (griddepcontrol.wait is
ACQBULK). Needs no GPU. Used by test_pdl.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from flotilla.kernels.gguf_dequant import GGUF_TYPES, Q4_K
from tests.kernels.sm90_compile import sass_sm90
from tests.quant.sm90_compile import BF16_IO, LANE_GEMV, W4

NORM = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
        "res_out_ptr": "*bf16", "eps": "fp32"}


def jobs() -> dict[str, tuple[str, str, dict[str, str], dict[str, Any], int]]:
    out = {}
    for pf in (False, True):
        out[f"w4a16 prefetch={pf}"] = (
            "w4a16_gemv", "_gemv_kernel", W4,
            LANE_GEMV | dict(HAS_PERM=False, BLOCK_N=16, NSB=8, PREFETCH=pf, USE_PDL=True), 4)
        out[f"q4k prefetch={pf}"] = (
            "gguf_kquant_gemv", "_kquant_gemv_kernel", BF16_IO | {"w_ptr": "*u8"},
            LANE_GEMV | dict(FIVE_BITS=False, TYPE_SIZE=GGUF_TYPES[Q4_K].type_size, BLOCK_N=16,
                             NSB=8, PREFETCH=pf, USE_PDL=True), 4)
        out[f"fp8 prefetch={pf}"] = (
            "fp8_gemv_fma", "_gemv_kernel", BF16_IO | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
            LANE_GEMV | dict(PER_CHANNEL=False, BLOCK_N=16, NSB=8, PREFETCH=pf, USE_PDL=True),
            4)
    out["rms_norm"] = ("rms_norm", "_rms_norm_kernel", NORM,
                       dict(HAS_RESIDUAL=True, BLOCK=4096, USE_PDL=True), 16)
    return out


def report() -> dict[str, dict[str, Any]]:
    result = {}
    for name, (module, kernel, types, constexprs, warps) in jobs().items():
        sass = sass_sm90(module, kernel, types, constexprs, warps)
        ops = [line.split("*/", 1)[1].strip() for line in sass.splitlines()
               if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        result[name] = {"acqbulk": [i for i, o in enumerate(ops) if o.startswith("ACQBULK")],
                        "ldg": [i for i, o in enumerate(ops) if "LDG" in o], "ops": len(ops)}
    return result


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the JIT compiler")
    print(json.dumps(report()))
