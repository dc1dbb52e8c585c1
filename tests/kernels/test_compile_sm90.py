"""The kernels compile for H100 (sm_90) with their default tiles, without register spills.

The interpreter never runs Triton's compiler, so type errors and unsupported constructs would only
show on a GPU. Triton ships ptxas, so sm90_compile.py builds real cubins on any machine; it runs
in a subprocess because this test session's kernels are decorated for the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton's bundled ptxas not found")
def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    spills = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(spills) == 16
    assert {name: n for name, n in spills.items() if n} == {}


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton's bundled ptxas not found")
def test_fp8_kv_cache_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", "fp8kv"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    spills = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(spills) == 11
    assert {name: n for name, n in spills.items() if n} == {}
