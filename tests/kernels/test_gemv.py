"""Small-batch GEMV (kernels/gemv.py) against torch: every inner-product path, the fused SiLU*mul
input, (slow) an sm_90 compile of every autotune config without spills, and the engine's
FLOTILLA_GEMV dispatch in the unquantized linear method."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul_ref
from flotilla.kernels.gemv import CONFIGS, GEMV_MAX_M, _config, gemv_triton
from flotilla.kernels.selection import KernelSelection
from flotilla.services.engine.layers.linear import ReplicatedLinear
from flotilla.services.engine.loader import bind_selection
from flotilla.services.engine.quant.base import (
    use_triton_gemv,
)
from tests.kernels.conftest import DEVICE, tolerance
from tests.kernels.sm90_report import needs_ptxas, sm90_report

# FMA and tensor-core tiles; small K blocks so a tiny K still takes several (masked) steps
PATHS = {"fma": _config(8, 64, False, 4), "dot": _config(16, 64, True, 4, 2), "default": None}


def _reference(x: torch.Tensor, w: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    """fp32 product of the 16-bit input the kernel reads (SiLU*mul rounded as torch does)."""
    a = silu_and_mul_ref(x) if silu_mul else x
    return F.linear(a.float(), w.float())


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("k", [160, 256], ids=["ragged_k", "even_k"])
def test_gemv_matches_torch(m: int, path: str, silu_mul: bool, k: int) -> None:
    config = PATHS[path]
    if m > 8 and path == "fma":
        pytest.skip("FMA tiles serve M <= 8")
    g = torch.Generator().manual_seed(m * 31 + k)
    n, dtype = 40, torch.bfloat16
    x = torch.randn(m, 2 * k if silu_mul else k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    out = gemv_triton(x.to(DEVICE), w.to(DEVICE), silu_mul, config)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.cpu().float(), _reference(x, w, silu_mul),
                               **tolerance(dtype, 2.0))


def test_gemv_fp16_leading_dims_and_strided_weight() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g).half()
    w_full = torch.randn(48, 80, generator=g).half()
    w = w_full[:, :64]  # rows 80 apart: the kernel must use the weight's row stride
    out = gemv_triton(x.to(DEVICE), w.to(DEVICE))
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out.cpu().float(), F.linear(x.float(), w.float()),
                               **tolerance(torch.float16, 2.0))


def test_gemv_rejects_what_it_cannot_serve() -> None:
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        gemv_triton(torch.zeros(GEMV_MAX_M + 1, 32, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="dtype"):
        gemv_triton(torch.zeros(1, 32), w.float())
    with pytest.raises(ValueError, match="features"):
        gemv_triton(torch.zeros(1, 32, dtype=torch.bfloat16), w, silu_mul=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_gemv_autotuned_real_sizes(m: int, n: int, k: int) -> None:
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    torch.testing.assert_close(gemv_triton(x, w).float(), F.linear(x.float(), w.float()),
                               **tolerance(torch.bfloat16))
    gu = torch.randn(m, 2 * k, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(gemv_triton(gu, w, silu_mul=True).float(),
                               _reference(gu, w, True), **tolerance(torch.bfloat16))


@pytest.mark.slow
@needs_ptxas
def test_gemv_configs_compile_for_sm90_without_spills() -> None:
    spills = sm90_report("tests.kernels.gemv_sm90", timeout=900)
    assert len(spills) >= len(CONFIGS)
    assert {name: n for name, n in spills.items() if n} == {}


# ------------------------------------------------------------------ engine dispatch


@pytest.mark.parametrize("backend,n,m,dtype,expected", [
    ("cublas", 64, 1, torch.bfloat16, False),
    ("triton", 64, 1, torch.bfloat16, True),
    ("triton", 64, 8, torch.float16, True),
    ("triton", 64, 9, torch.bfloat16, False),  # beyond the decode buckets it serves
    ("triton", 64, 1, torch.float32, False),
    ("auto", 64, 1, torch.bfloat16, True),
    ("auto", 28672, 1, torch.bfloat16, True),  # gate_up-wide: ties with cuBLAS at M=1
    ("auto", 64, 2, torch.bfloat16, False),  # M >= 2: cuBLAS measured faster
])
def test_gemv_backend_picks_triton_only_for_decode_sized_16bit_inputs(
        backend: str, n: int, m: int, dtype: torch.dtype, expected: bool) -> None:
    w = torch.empty(n, 16, dtype=dtype, device="meta")
    gemv = KernelSelection(gemv=backend).gemv  # type: ignore[arg-type]
    assert use_triton_gemv(torch.empty(m, 16, dtype=dtype, device="meta"), w, gemv) is expected


def test_gemv_backend_defaults_to_auto_and_comes_from_the_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flotilla.libs.common.settings import EngineSettings
    from flotilla.services.engine.factory import kernel_selection

    monkeypatch.delenv("FLOTILLA_GEMV", raising=False)
    assert kernel_selection(EngineSettings()).gemv == "auto"
    monkeypatch.setenv("FLOTILLA_GEMV", "triton")
    assert kernel_selection(EngineSettings()).gemv == "triton"
    monkeypatch.setenv("FLOTILLA_GEMV", "cutlass")
    with pytest.raises(ValueError, match="gemv"):
        EngineSettings()


@pytest.mark.gpu
def test_gpu_unquantized_linear_through_triton_gemv() -> None:
    layer = ReplicatedLinear(4096, 6144, bias=True).to("cuda", torch.bfloat16)
    bind_selection(layer, KernelSelection(gemv="triton"))
    torch.nn.init.normal_(layer.weight, std=0.02)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(layer(x).float(),
                               F.linear(x.float(), layer.weight.float(), layer.bias.float()),
                               **tolerance(torch.bfloat16))
