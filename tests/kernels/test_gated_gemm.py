"""The fused gate/up GEMM (kernels/gated_gemm.py) against the unfused matmul + silu * up."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.activation import silu_and_mul_triton
from flotilla.kernels.gated_gemm import (
    CONFIGS,
    CUDA_CONFIG,
    gated_gemm_ok,
    gated_gemm_ref,
    gated_gemm_triton,
)
from tests.kernels.conftest import DEVICE, tolerance

SMALL = (16, 16, 16, 4, 2)  # many tiles at interpreter sizes: bands, edges, several programs


def _inputs(m: int, inter: int, k: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * inter, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,inter,k", [(1, 16, 16), (37, 40, 48), (50, 24, 96), (16, 64, 16)])
def test_gated_gemm_matches_unfused(dtype: torch.dtype, m: int, inter: int, k: int) -> None:
    x, w = _inputs(m, inter, k, dtype, seed=m * 1000 + inter + k)
    out = gated_gemm_triton(x, w, config=SMALL)
    assert out.shape == (m, inter) and out.dtype == dtype
    assert not out.isnan().any()
    ref = gated_gemm_ref(x.double(), w.double()).to(dtype)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_gated_gemm_rounds_like_the_unfused_kernel() -> None:
    """silu and the product are rounded as the separate SiLU·mul kernel rounds them: with the
    same gate/up values the fused output equals the unfused one where the fp32 dots agree."""
    x, w = _inputs(33, 32, 64, torch.bfloat16, seed=3)
    fused = gated_gemm_triton(x, w, config=SMALL).float()
    unfused = silu_and_mul_triton((x.float() @ w.float().T).to(torch.bfloat16)).float()
    # the only difference left is the order of the fp32 accumulation: at most one bf16 ulp
    assert ((fused - unfused).abs() <= unfused.abs() * 2 ** -7 + 1e-6).all()


def test_gated_gemm_leading_dims_and_default_config() -> None:
    x, w = _inputs(12, 32, 64, torch.bfloat16, seed=5)
    out = gated_gemm_triton(x.reshape(3, 4, 64), w)  # DEFAULT_CONFIG: one tile
    assert out.shape == (3, 4, 32)
    torch.testing.assert_close(out.reshape(12, 32), gated_gemm_ref(x.float(), w.float()).to(
        torch.bfloat16), **tolerance(torch.bfloat16))


def test_gated_gemm_empty_and_layout_checks() -> None:
    x, w = _inputs(0, 16, 16, torch.bfloat16, seed=1)
    assert gated_gemm_triton(x, w).shape == (0, 16)
    x, w = _inputs(4, 16, 16, torch.bfloat16, seed=1)
    assert gated_gemm_ok(x, w)
    assert not gated_gemm_ok(x.float(), w.float())  # 16-bit only
    assert not gated_gemm_ok(x, w[:, :8])  # K mismatch
    assert not gated_gemm_ok(x[:, 1:9], w[:, 1:9])  # unaligned start
    x12, w12 = _inputs(4, 12, 16, torch.bfloat16, seed=1)
    assert not gated_gemm_ok(x12, w12)  # I = 12: the up half starts off the 16-byte grid


def test_dispatch_falls_back_once_the_kernel_cannot_be_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A build failure (e.g. Triton's warp specialisation on another GPU / build) turns the fused
    path off for the process instead of failing requests."""
    from flotilla.services.engine.quant import base

    def broken(*_: object, **__: object) -> torch.Tensor:
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(base, "gated_gemm_triton", broken)
    monkeypatch.setattr(base, "_gated_gemm_built", None)
    x, w = _inputs(4, 16, 16, torch.bfloat16, seed=1)
    assert base._gated_gemm(x, w) is None
    assert base._gated_gemm_built is False
    assert not base.use_gated_gemm(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("config,warp_spec", [(None, None), (CUDA_CONFIG, False),
                                              *[(c, False) for c in CONFIGS if c != CUDA_CONFIG]])
@pytest.mark.parametrize("m", [1000, 4096])
def test_gated_gemm_gpu_llama3_shape(config: tuple[int, int, int, int, int] | None,
                                     warp_spec: bool | None, m: int) -> None:
    """Llama-3-8B's gate/up at prefill sizes, the CUDA default (warp-specialised) and every tile
    config without specialisation, fresh random inputs."""
    x, w = _inputs(m, 14336, 4096, torch.bfloat16, seed=m)
    out = gated_gemm_triton(x, w, config=config, warp_spec=warp_spec)
    ref = silu_and_mul_triton(x @ w.T)
    assert not out.isnan().any()
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, err


@pytest.mark.gpu
def test_unquantized_gated_projection_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Hopper, gated_gemm=auto (FLOTILLA_GATED_GEMM) fuses prefill-sized inputs
    (>= GATED_GEMM_MIN_ROWS rows) and leaves smaller ones to cuBLAS + SiLU·mul; 0 never fuses;
    both give the same y."""
    from torch import nn

    from flotilla.kernels.selection import KernelSelection
    from flotilla.services.engine.quant import base

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("auto fuses on Hopper and later only")
    calls: list[int] = []
    real = base.gated_gemm_triton
    monkeypatch.setattr(base, "gated_gemm_triton",
                        lambda x, w: calls.append(x.shape[0]) or real(x, w))
    layer = nn.Module()
    layer.weight = nn.Parameter(_inputs(1, 1024, 512, torch.bfloat16, seed=9)[1],
                                requires_grad=False)
    method = base.UnquantizedLinearMethod()
    rows = base.GATED_GEMM_MIN_ROWS
    cases = (("auto", rows, True), ("auto", rows // 2, False), ("0", rows, False))
    for mode, m, fused in cases:
        method.selection = KernelSelection(gated_gemm=mode)  # type: ignore[arg-type]
        calls.clear()
        x = _inputs(m, 1024, 512, torch.bfloat16, seed=m)[0]
        y = method.apply_gated(layer, x)
        assert bool(calls) is fused, (mode, m)
        ref = silu_and_mul_triton(x @ layer.weight.T)
        assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
