"""The kernels compile for H100 (sm_90) with their default tiles, without register spills.

The interpreter never runs Triton's compiler, so type errors and unsupported constructs would only
show on a GPU. Triton ships ptxas, so sm90_compile.py builds real cubins on any machine; it runs
in a subprocess because this test session's kernels are decorated for the interpreter.
"""

from __future__ import annotations

import pytest

from tests.kernels.sm90_report import needs_ptxas, sm90_report


@pytest.mark.slow
@needs_ptxas
def test_kernels_compile_for_sm90_without_spills() -> None:
    spills = sm90_report("tests.kernels.sm90_compile", timeout=600)
    assert len(spills) == 16
    assert {name: n for name, n in spills.items() if n} == {}


@pytest.mark.slow
@needs_ptxas
def test_fp8_kv_cache_kernels_compile_for_sm90_without_spills() -> None:
    spills = sm90_report("tests.kernels.sm90_compile", "fp8kv", timeout=600)
    assert len(spills) == 11
    assert {name: n for name, n in spills.items() if n} == {}
