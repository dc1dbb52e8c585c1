"""Compile the Gated DeltaNet and causal-conv kernels for H100 (sm_90) at Qwen3-Next-80B sizes
(Hk=16, Hv=32, Dk=Dv=128, conv width 4, bf16 activations) with the launchers' tiles and report
register spills. Run as `python -m tests.kernels.gated_delta_sm90` without TRITON_INTERPRET
(tests/kernels/sm90_report.py); prints one JSON object {kernel: spill bytes}."""

from __future__ import annotations

import json
from typing import Any

import flotilla.kernels.causal_conv1d
import flotilla.kernels.gated_delta_chunk
import flotilla.kernels.gated_delta_recurrent  # noqa: F401  (the kernel modules compile_sm90 looks up)
from tests.kernels.sm90_compile import compile_sm90, spill_bytes

BF16, F32, I32 = "*bf16", "*fp32", "*i32"
HEADS = dict(HV=32, DK=128, DV=128, GROUP=2, BK=128, USE_L2=True)
CHUNK = HEADS | dict(CHUNK=64)

CASES: list[tuple[str, str, dict[str, str], dict[str, Any], int]] = [
    ("gated_delta_chunk", "_chunk_prepare_kernel",
     {"k_ptr": BF16, "v_ptr": BF16, "g_ptr": F32, "beta_ptr": BF16, "chunk_seq_ptr": I32,
      "chunk_start_ptr": I32, "cu_ptr": I32, "gcum_ptr": F32, "w_ptr": F32, "u_ptr": F32},
     CHUNK | dict(BV=32, PRECISION="tf32x3"), 4),
    ("gated_delta_chunk", "_chunk_state_kernel",
     {"k_ptr": BF16, "gcum_ptr": F32, "w_ptr": F32, "u_ptr": F32, "cu_ptr": I32,
      "first_ptr": I32, "init_ptr": F32, "h_ptr": F32, "final_ptr": F32},
     CHUNK | dict(BV=32, HAS_INIT=True, PRECISION="tf32"), 8),
    ("gated_delta_chunk", "_chunk_output_kernel",
     {"q_ptr": BF16, "k_ptr": BF16, "gcum_ptr": F32, "v_new_ptr": F32, "h_ptr": F32,
      "chunk_seq_ptr": I32, "chunk_start_ptr": I32, "cu_ptr": I32, "o_ptr": BF16,
      "scale": "fp32"},
     CHUNK | dict(BV=64, PRECISION="tf32"), 8),
    ("gated_delta_recurrent", "_recurrent_update_kernel",
     {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "g_ptr": F32, "beta_ptr": BF16,
      "state_ptr": F32, "slot_ptr": I32, "o_ptr": BF16, "scale": "fp32"},
     HEADS | dict(BV=32), 4),
    ("causal_conv1d", "_conv_varlen_kernel",
     {"x_ptr": BF16, "w_ptr": BF16, "b_ptr": BF16, "state_ptr": BF16, "slot_ptr": I32,
      "init_ptr": "*i8", "chunk_seq_ptr": I32, "chunk_start_ptr": I32, "cu_ptr": I32,
      "y_ptr": BF16},
     dict(W=4, BW=4, HAS_BIAS=True, BT=32, BC=128), 4),
    ("causal_conv1d", "_conv_update_kernel",
     {"x_ptr": BF16, "w_ptr": BF16, "b_ptr": BF16, "state_ptr": BF16, "slot_ptr": I32,
      "y_ptr": BF16},
     dict(W=4, BW=4, HAS_BIAS=True, BC=256), 4),
]  # fmt: skip


def spill_report() -> dict[str, int]:
    return {
        kernel: spill_bytes(compile_sm90(module, kernel, types, constexprs, warps))
        for module, kernel, types, constexprs, warps in CASES
    }


if __name__ == "__main__":
    print(json.dumps(spill_report()))
