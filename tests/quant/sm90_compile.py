"""Compile the quantized-matmul kernels for H100 (sm_90) with their default tiles; report spills.

Run as `python -m tests.quant.sm90_compile [ggml type ids]` without TRITON_INTERPRET; prints one
JSON object {config: spill bytes} (every GGUF type by default). Needs no GPU (triton ships
ptxas). Used by test_compile_sm90.py. `... sm90_compile fp8loop` / `gemvloop` / `kquantgemm`:
SASS instructions per weight in the hot loop of every tensor-core fp8 GEMV config / of every
lanes-along-K GEMV config (Q4_K, Q5_K, 4-bit, fp8) / of the Q4_K and Q5_K GEMM instead;
`w4gemmloop`: of the 4-bit batched-decode GEMMs (re-packed layout and nibble planes).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from flotilla import kernels  # noqa: F401  (loads the kernel modules)
from flotilla.kernels.gguf_dequant import GGUF_TYPES, Q4_K, Q5_K
from flotilla.kernels.gguf_matmul import gemm_config
from tests.kernels.sm90_compile import compile_sm90, hot_loop, sass_sm90, spill_bytes

BF16_IO = {"x_ptr": "*bf16", "out_ptr": "*bf16"}
# the Q4_K / Q5_K, 4-bit and fp8 CUDA-core GEMVs as run on CUDA with bf16 x (K a multiple of
# the step)
LANE_GEMV = dict(USE_ASM=True, X_WORDS=True, EVEN=True, GATED=False)
W4 = BF16_IO | {"q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "perm_ptr": "*i32"}
FP8_GEMV = BF16_IO | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "ws_ptr": "*fp32",
                      "lock_ptr": "*i32"}


def configs(qtypes: list[int] | None = None
            ) -> list[tuple[str, str, dict[str, str], dict[str, Any], int]]:
    gguf = BF16_IO | {"w_ptr": "*u8", "w16_ptr": "*fp16"}
    out: list[tuple[str, str, dict[str, str], dict[str, Any], int]] = []
    for qtype, t in sorted(GGUF_TYPES.items()):
        if qtypes is not None and qtype not in qtypes:
            continue
        common = dict(QTYPE=qtype, QK=t.qk, TYPE_SIZE=t.type_size)
        out.append(("gguf_matmul", "_gemv_kernel", gguf,
                    common | dict(BLOCK_N=8, NSB=8 if t.qk == 256 else 32), 4))
        nsb, warps = gemm_config(qtype)
        for bm, atomic in ((16, True), (64, False)):
            out.append(("gguf_matmul", "_gemm_kernel",
                        gguf | ({"out_ptr": "*fp32"} if atomic else {}),
                        common | dict(BLOCK_M=bm, BLOCK_N=64, NSB=nsb, ATOMIC=atomic,
                                      DOT_PRECISION="tf32"), warps))
    for qtype in (Q4_K, Q5_K):
        if qtypes is None or qtype in qtypes:
            out.extend(kquant_gemm_configs(qtype))
    for qtype, gated in ((Q4_K, False), (Q5_K, False), (Q4_K, True)):  # gated: gate/up + SiLU
        out.append(("gguf_kquant_gemv", "_kquant_gemv_kernel", gguf,
                    LANE_GEMV | dict(FIVE_BITS=qtype == Q5_K,
                                       TYPE_SIZE=GGUF_TYPES[qtype].type_size, BLOCK_N=16,
                                       NSB=8, PREFETCH=False, GATED=gated), 4))
    for perm, gated in ((False, False), (True, False), (False, True)):
        out.append(("w4a16_gemv", "_gemv_kernel", W4,
                    LANE_GEMV | dict(HAS_PERM=perm, BLOCK_N=16, NSB=8, PREFETCH=False,
                                     GATED=gated), 4))
        out.append(("w4a16", "_gemm_kernel", W4 | {"out_ptr": "*fp32"},
                    dict(HAS_PERM=perm, USE_ASM=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64,
                         ATOMIC=True, DOT_PRECISION="tf32"), 4))
    for perm in (False, True):  # the re-packed layout's GEMM, 16 rows, its widest default tile
        out.append(("w4a16_marlin", "_marlin_kernel", W4 | {"ws_ptr": "*fp32",
                                                             "lock_ptr": "*i32"},
                    dict(HAS_PERM=perm, USE_ASM=True, PRECISION="tf32", BLOCK_M=16, BLOCK_N=128,
                         BLOCK_K=256, SPLIT_K=8, SWAP=True, GROUP=128), 4))
    fp8 = BF16_IO | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    for gated in (False, True):
        out.append(("fp8_gemv_fma", "_gemv_kernel", fp8,
                    LANE_GEMV | dict(PER_CHANNEL=True, BLOCK_N=16, NSB=8, PREFETCH=False,
                                     GATED=gated), 4))
    out.append(("fp8", "_gemm_kernel", fp8,
                dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32"), 4))
    for constexprs, warps, _ in fp8_gemv_configs(tuned=False):
        out.append(("fp8_gemv", "_gemv_mma_kernel", FP8_GEMV, constexprs, warps))
    return out



def kquant_gemm_configs(qtype: int
                        ) -> list[tuple[str, str, dict[str, str], dict[str, Any], int]]:
    """The Q4_K / Q5_K GEMM (kernels/gguf_kquant_gemm.py) with the tiles of kquant_gemm_config:
    a few rows with split-K (fp32 atomics) and prefill."""
    from flotilla.kernels.gguf_kquant_gemm import kquant_gemm_config

    out = []
    for m, atomic in ((16, True), (512, False)):
        bm, bn, warps = kquant_gemm_config(m)
        types = BF16_IO | {"w_ptr": "*u8"} | ({"out_ptr": "*fp32"} if atomic else {})
        out.append(("gguf_kquant_gemm", "_kquant_gemm_kernel", types,
                    dict(FIVE_BITS=qtype == Q5_K, TYPE_SIZE=GGUF_TYPES[qtype].type_size,
                         USE_ASM=True, BLOCK_M=bm, BLOCK_N=bn, ATOMIC=atomic,
                         DOT_PRECISION="tf32"), warps))
    return out


def kquant_gemm_loop_report() -> dict[str, float]:
    """{config: SASS instructions per weight in the Q4_K / Q5_K GEMM's loop}: the loop's
    instructions / the weights one thread decodes per step (BLOCK_N * 256 / threads)."""
    report = {}
    for qtype in (Q4_K, Q5_K):
        for module, kernel, types, constexprs, warps in kquant_gemm_configs(qtype):
            body = hot_loop(sass_sm90(module, kernel, types, constexprs, warps), containing="PRMT")
            name = " ".join(f"{k}={v}" for k, v in constexprs.items()) + f" w{warps}"
            report[name] = round(len(body) / (constexprs["BLOCK_N"] * 256 / (32 * warps)), 3)
    return report


def w4_gemm_loop_report() -> dict[str, float]:
    """{config: SASS instructions per weight in the loop of the 4-bit batched-decode GEMMs}
    (M = 16 bf16 rows, groups of 128): every autotune config of the re-packed layout's GEMM
    (kernels/w4a16_marlin.py) and of the nibble-plane GEMM it replaces (kernels/w4a16_mma.py):
    the loop's instructions / (BLOCK_N * BLOCK_K / threads)."""
    from flotilla.kernels import w4a16_marlin, w4a16_mma

    types = W4 | {"ws_ptr": "*fp32", "lock_ptr": "*i32"}
    common = dict(HAS_PERM=False, USE_ASM=True, PRECISION="tf32", BLOCK_M=16, SPLIT_K=8)
    jobs = [("w4a16_marlin", "_marlin_kernel", common | {"GROUP": 128} | c.kwargs | {
        "SPLIT_K": 8}, c.num_warps, c.num_stages) for c in w4a16_marlin.MARLIN_CONFIGS
        if c.kwargs["SPLIT_K"] == 8]
    jobs += [("w4a16_mma", "_mma_kernel", common | {"SCALE_PER_WORD": False} | c.kwargs | {
        "SPLIT_K": 8}, c.num_warps, c.num_stages) for c in w4a16_mma.MMA_CONFIGS
        if c.kwargs["SPLIT_K"] == 8]
    report = {}
    for module, kernel, constexprs, warps, stages in jobs:
        body = hot_loop(sass_sm90(module, kernel, types, constexprs, warps, stages),
                        containing="MMA")
        per_thread = constexprs["BLOCK_N"] * constexprs["BLOCK_K"] / (32 * warps)
        name = f"{module} " + " ".join(f"{k}={constexprs[k]}" for k in (
            "BLOCK_N", "BLOCK_K", "SWAP", "X_TILE") if k in constexprs) + f" w{warps}"
        report[name] = round(len(body) / per_thread, 3)
    return report


def fp8_gemv_configs(tuned: bool = True) -> list[tuple[dict[str, Any], int, int]]:
    """(constexprs, warps, stages) of the tensor-core fp8 GEMV: every autotune config (or the
    fallback tile) with M = 2 bf16 rows, per-channel and (where BLOCK_K divides 128) groups of
    128."""
    from flotilla.kernels import fp8_gemv

    out = []
    for c in [*fp8_gemv.CONFIGS, fp8_gemv.FALLBACK] if tuned else [fp8_gemv.FALLBACK]:
        for per_channel in (True, False):
            if per_channel or 128 % c.kwargs["BLOCK_K"] == 0:
                out.append((dict(BLOCK_M=2, SCALE_X=True, PER_CHANNEL=per_channel, EVEN_K=True,
                                 **c.kwargs), c.num_warps, c.num_stages))
    return out


def fp8_gemv_loop_report() -> dict[str, dict[str, float]]:
    """{config: instructions per weight in the weight loop, 2-byte shared loads there}: the loop
    (the one with the wgmma) instructions / (BLOCK_N * BLOCK_K / threads), the weights one
    thread handles per step."""
    report = {}
    for constexprs, warps, stages in fp8_gemv_configs():
        body = hot_loop(sass_sm90("fp8_gemv", "_gemv_mma_kernel", FP8_GEMV, constexprs, warps,
                                  stages), containing="HGMMA")
        per_thread = constexprs["BLOCK_N"] * constexprs["BLOCK_K"] / (32 * warps)
        name = " ".join(f"{k}={v}" for k, v in constexprs.items()) + f" w{warps} s{stages}"
        report[name] = {"per_weight": round(len(body) / per_thread, 3),
                        "lds_u16": sum("LDS.U16" in t for t in body)}
    return report


def lane_gemv_jobs() -> list[tuple[str, str, dict[str, str], dict[str, Any], int, int]]:
    """(module, kernel, types, constexprs, warps, weights one thread handles per step) of every
    autotune config of the lanes-along-K GEMVs: Q4_K / Q5_K, 4-bit (plain and act-order), fp8
    (per-channel and group scales)."""
    from flotilla.kernels import fp8_gemv_fma, gguf_kquant_gemv, w4a16_gemv

    gguf = BF16_IO | {"w_ptr": "*u8"}
    fp8 = BF16_IO | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    jobs = []
    for qtype, configs in ((Q4_K, gguf_kquant_gemv.GEMV_CONFIGS),
                           (Q5_K, gguf_kquant_gemv.GEMV_CONFIGS_Q5)):
        for c in configs:
            jobs.append(("gguf_kquant_gemv", "_kquant_gemv_kernel", gguf,
                         LANE_GEMV | dict(FIVE_BITS=qtype == Q5_K,
                                          TYPE_SIZE=GGUF_TYPES[qtype].type_size, **c.kwargs),
                         c.num_warps, 256))
    for c in w4a16_gemv.GEMV_CONFIGS:
        for perm, marlin in ((False, False), (True, False), (False, True)):  # marlin: re-packed
            jobs.append(("w4a16_gemv", "_gemv_kernel", W4,
                         LANE_GEMV | dict(HAS_PERM=perm, MARLIN=marlin, **c.kwargs),
                         c.num_warps, 256))
    for c in fp8_gemv_fma.GEMV_CONFIGS:
        for per_channel in (True, False):
            jobs.append(("fp8_gemv_fma", "_gemv_kernel", fp8,
                         LANE_GEMV | dict(PER_CHANNEL=per_channel, **c.kwargs), c.num_warps,
                         128))
    return [(module, kernel, types, ce, warps, ce["BLOCK_N"] * ce["NSB"] * block // (32 * warps))
            for module, kernel, types, ce, warps, block in jobs]


def lane_gemv_loop_report() -> dict[str, dict[str, float]]:
    """{config: instructions per weight in the loop, its shared-memory instructions} for every
    job of lane_gemv_jobs: the loop's instructions / the weights one thread handles per step."""
    report = {}
    for module, kernel, types, constexprs, warps, per_thread in lane_gemv_jobs():
        body = hot_loop(sass_sm90(module, kernel, types, constexprs, warps), containing="FFMA")
        name = f"{module} " + " ".join(f"{k}={v}" for k, v in constexprs.items()) + f" w{warps}"
        report[name] = {"per_weight": round(len(body) / per_thread, 3),
                        "shared": sum(t.split()[0] in ("LDS", "STS", "BAR.SYNC")
                                      or t.startswith(("LDS.", "STS.")) for t in body)}
    return report


def spill_report(qtypes: list[int] | None = None) -> dict[str, int]:
    report = {}
    for module, kernel, types, constexprs, warps in configs(qtypes):
        name = f"{module}.{kernel} " + " ".join(
            f"{k}={v}" for k, v in constexprs.items() if k not in ("DOT_PRECISION", "QK"))
        report[name] = spill_bytes(compile_sm90(module, kernel, types, constexprs, warps))
    return report


def tuned_gemv_report() -> dict[str, int]:
    """Spill bytes of every autotune config of the decode GEMVs (lanes-along-K GEMVs and the
    tensor-core fp8 one)."""
    report = {}
    for module, kernel, types, constexprs, warps, _ in lane_gemv_jobs():
        name = f"{module}.{kernel} " + " ".join(f"{k}={v}" for k, v in constexprs.items()) + \
            f" warps={warps}"
        report[name] = spill_bytes(compile_sm90(module, kernel, types, constexprs, warps))
    for constexprs, warps, stages in fp8_gemv_configs():  # pipelined: their own stages
        name = "fp8_gemv._gemv_mma_kernel " + " ".join(
            f"{k}={v}" for k, v in constexprs.items()) + f" warps={warps} stages={stages}"
        report[name] = spill_bytes(compile_sm90("fp8_gemv", "_gemv_mma_kernel", FP8_GEMV,
                                                constexprs, warps, stages))
    return report


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the JIT compiler")
    if sys.argv[1:] == ["tuned"]:  # every autotune config of the decode GEMVs
        print(json.dumps(tuned_gemv_report()))
        sys.exit(0)
    if sys.argv[1:] == ["gemvloop"]:
        print(json.dumps(lane_gemv_loop_report()))
        sys.exit(0)
    if sys.argv[1:] == ["kquantgemm"]:
        print(json.dumps(kquant_gemm_loop_report()))
        sys.exit(0)
    if sys.argv[1:] == ["w4gemmloop"]:
        print(json.dumps(w4_gemm_loop_report()))
        sys.exit(0)
    if sys.argv[1:] == ["fp8loop"]:
        print(json.dumps(fp8_gemv_loop_report()))
        sys.exit(0)
    # argv: ggml type ids to compile (default: all ten)
    print(json.dumps(spill_report([int(a) for a in sys.argv[1:]] or None)))
