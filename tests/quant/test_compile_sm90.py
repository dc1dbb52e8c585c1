"""The quantized-matmul kernels compile for H100 (sm_90) without register spills.

The interpreter never runs Triton's compiler; sm90_compile.py builds real cubins (triton ships
ptxas) in a subprocess, since this session's kernels are decorated for the interpreter.
"""

from __future__ import annotations

import pytest

from flotilla.kernels.gguf_dequant import Q4_1, Q4_K, Q6_K
from tests.kernels.sm90_report import needs_ptxas, sm90_report


@pytest.mark.slow
@needs_ptxas
def test_quant_kernels_compile_for_sm90_without_spills() -> None:
    # one type per decoder family (32-weight, k-quant 32 / 16-weight sub-blocks) keeps this
    # near a minute; `python -m tests.quant.sm90_compile` compiles all ten
    types = [str(q) for q in (Q4_1, Q4_K, Q6_K)]
    spills = sm90_report("tests.quant.sm90_compile", *types, timeout=900)
    # GGUF GEMV + 2 GEMMs per type, Q4_K GEMM (2 tiles), k-quant GEMVs (Q4_K, Q5_K, gated Q4_K),
    # w4a16 (GEMV plain / act-order / gated, GEMM plain / act-order, re-packed GEMM plain /
    # act-order), fp8 GEMV (plain, gated) + GEMM, tensor-core fp8 GEMV
    assert len(spills) == 3 * 3 + 2 + 3 + 5 + 2 + 3 + 2
    assert {name: n for name, n in spills.items() if n} == {}


@pytest.mark.slow
@needs_ptxas
def test_decode_gemv_autotune_configs_compile_for_sm90_without_spills() -> None:
    spills = sm90_report("tests.quant.sm90_compile", "tuned", timeout=900)
    from tests.quant.sm90_compile import fp8_gemv_configs, lane_gemv_jobs

    assert len(spills) == len(lane_gemv_jobs()) + len(fp8_gemv_configs())
    assert {name: n for name, n in spills.items() if n} == {}


@pytest.mark.slow
@needs_ptxas
def test_w4_gemm_loop_leaner_on_the_repacked_layout() -> None:
    """The 4-bit batched-decode GEMM (16 rows, groups of 128), every autotune config with
    split-K: on the re-packed layout (kernels/w4a16_marlin.py: LOP3 magic-number pairs, wgmma
    with the planes as register operand) at most 3.6 SASS instructions per weight with weight
    rows as the MMA's M and K steps of 128+ (now 2.2-3.5), and every config with such steps
    below the nibble-plane GEMM's best (kernels/w4a16_mma.py: 4.6-6.5; the re-packed steps of
    64, offered for groups of 64 only: 5.1-5.3)."""
    report = sm90_report("tests.quant.sm90_compile", "w4gemmloop", timeout=1200)
    new = {k: v for k, v in report.items() if k.startswith("w4a16_marlin")}
    old = {k: v for k, v in report.items() if k.startswith("w4a16_mma")}
    assert new and old
    assert {k: v for k, v in new.items() if "SWAP=True" in k and "BLOCK_K=64" not in k
            and v > 3.6} == {}
    assert max(v for k, v in new.items() if "BLOCK_K=64" not in k) < min(old.values())


@pytest.mark.slow
@needs_ptxas
def test_lane_gemv_loops_stay_lean() -> None:
    """The lanes-along-K decode GEMVs' loops, every autotune config: no shared-memory round trips
    (Triton laying x out apart from the weight words again, as a tl.load of the scales did in the
    4-bit GEMV: 5.1 per weight) and at most (SASS instructions per weight; now): Q4_K 4.5
    (3.4-4.4), Q5_K 5.2 (4.2-4.9), 4-bit 4.3 (3.0-4.1), 4-bit act-order 6.0 (3.4-5.7), fp8 4.0
    per-channel (2.9-3.7) / 4.4 group scales (3.1-4.1). The tl.load kernels before them took
    8.2-12.4 (Q4_K), 4.1-4.3 (4-bit, x through shared memory) and ~7 (fp8)."""
    report = sm90_report("tests.quant.sm90_compile", "gemvloop", timeout=1200)
    from tests.quant.sm90_compile import lane_gemv_jobs

    def limit(name: str) -> float:
        if name.startswith("gguf_kquant_gemv"):
            return 5.2 if "FIVE_BITS=True" in name else 4.5
        if name.startswith("w4a16_gemv"):
            return 6.0 if "HAS_PERM=True" in name else 4.3
        return 4.0 if "PER_CHANNEL=True" in name else 4.4

    assert len(report) == len(lane_gemv_jobs())
    assert {name: r for name, r in report.items() if r["shared"]
            or r["per_weight"] > limit(name)} == {}


@pytest.mark.slow
@needs_ptxas
def test_fp8_gemv_weight_loop_stays_lean() -> None:
    """The tensor-core fp8 GEMV's weight loop: no 2-byte shared loads (the K reorder of
    kernels/fp8_gemv.py lost: Triton converting the fp8 tile through shared memory again) and
    at most 2.5 (per-channel) / 3.5 (group scales) SASS instructions per weight."""
    report = sm90_report("tests.quant.sm90_compile", "fp8loop", timeout=900)
    from flotilla.kernels.fp8_gemv import FALLBACK

    fallback = " ".join(f"{k}={v}" for k, v in FALLBACK.kwargs.items())
    tuned = {name: r for name, r in report.items() if fallback not in name}
    assert len(tuned) > 10
    assert {name: r for name, r in tuned.items() if r["lds_u16"]
            or r["per_weight"] > (2.5 if "PER_CHANNEL=True" in name else 3.5)} == {}


@pytest.mark.slow
@needs_ptxas
def test_kquant_gemm_loop_stays_lean() -> None:
    """The Q4_K / Q5_K GEMM's loop (kernels/gguf_kquant_gemm.py), both tiles: at most 5.3 (Q4_K)
    / 5.8 (Q5_K) SASS instructions per weight (4.7-4.9 / 5.2-5.5 now; the generic GEMM of
    kernels/gguf_matmul.py takes 8.9-10.1 / 11.2-12.1)."""
    report = sm90_report("tests.quant.sm90_compile", "kquantgemm", timeout=900)
    assert len(report) == 4
    assert {name: r for name, r in report.items()
            if r > (5.8 if "FIVE_BITS=True" in name else 5.3)} == {}
