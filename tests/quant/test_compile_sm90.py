"""The quantized-matmul kernels compile for H100 (sm_90) without register spills.

The interpreter never runs Triton's compiler; sm90_compile.py builds real cubins (triton ships
ptxas) in a subprocess, since this session's kernels are decorated for the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from kernels.gguf_dequant import Q4_1, Q4_K, Q6_K

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton's bundled ptxas not found")
def test_quant_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # one type per decoder family (32-weight, k-quant 32 / 16-weight sub-blocks) keeps this
    # near a minute; `python -m tests.quant.sm90_compile` compiles all ten
    types = [str(q) for q in (Q4_1, Q4_K, Q6_K)]
    result = subprocess.run([sys.executable, "-m", "tests.quant.sm90_compile", *types], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    spills = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(spills) == 3 * 3 + 2 + 4 + 2
    assert {name: n for name, n in spills.items() if n} == {}


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton's bundled ptxas not found")
def test_decode_gemv_autotune_configs_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.quant.sm90_compile", "tuned"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    spills = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(spills) == 8 + 7 + 2 * 8 + 8  # w4a16 (+ act-order), Q4_K / Q5_K, fp8
    assert {name: n for name, n in spills.items() if n} == {}
