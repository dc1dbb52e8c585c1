"""SiLU·mul stored by the decode GEMVs (kernels/gemv_rows.py): each of the four GEMVs (bf16,
GPTQ/AWQ 4-bit, Q4_K/Q5_K, fp8 on CUDA cores) with `gated` gives exactly silu_and_mul of its
ungated output (same dot products, same rounding), over ragged column counts (I not a multiple
of the columns per program) and two x rows; the matmul entry points fuse it where they pick the
GEMV and fall back to the separate kernel elsewhere; the quant methods' `apply_gated` and the
llama MLP go through it."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from flotilla.kernels.activation import silu_and_mul_triton
from flotilla.kernels.fp8 import fp8_matmul_triton, quantize_fp8_per_channel
from flotilla.kernels.fp8_gemv_fma import fp8_gemv_fma
from flotilla.kernels.gemv import _config, gemv_triton
from flotilla.kernels.gguf_dequant import Q4_K, Q5_K
from flotilla.kernels.gguf_kquant_gemv import kquant_gemv_triton
from flotilla.kernels.gguf_matmul import gguf_matmul_triton
from flotilla.kernels.w4a16 import pack_int4, w4a16_matmul_triton
from flotilla.kernels.w4a16_gemv import w4a16_gemv
from flotilla.services.engine.layers.activation import SiluAndMul, gated_projection
from flotilla.services.engine.layers.linear import MergedColumnParallelLinear
from flotilla.services.engine.quant.base import layer_tensor
from tests.quant.conftest import DEVICE
from tests.quant.test_gguf_kernels import random_blocks

INTER = (5, 12)  # gate/up rows each: 5 = ragged against 4 columns a program, 12 = 3 programs


def _w4(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8, generator=g)
    return pack_int4(codes).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _same(gated: torch.Tensor, ungated: torch.Tensor) -> None:
    want = silu_and_mul_triton(ungated)
    assert gated.shape == want.shape and gated.dtype == want.dtype
    if DEVICE == "cpu":
        assert torch.equal(gated, want)
    else:  # a row's lanes may be reduced in another order inside the tile: 1 ulp
        torch.testing.assert_close(gated.float(), want.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dot", [False, True], ids=["fma", "dot"])
def test_bf16_gemv(inter: int, dtype: torch.dtype, dot: bool) -> None:
    """Both inner products (FMA tiles; tensor-core tiles with x padded to 16 rows), 2 x rows."""
    x = _x(2, 96, dtype, inter)
    w = (torch.randn(2 * inter, 96, generator=torch.Generator().manual_seed(1)) / 8).to(dtype)
    config = _config(16, 64, True, 4, 2) if dot else _config(8, 64, False, 4)
    _same(gemv_triton(x, w.to(DEVICE), config=config, gated=True),
          gemv_triton(x, w.to(DEVICE), config=config))


@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("with_perm", [False, True], ids=["plain", "perm"])
def test_w4a16_gemv(inter: int, with_perm: bool) -> None:
    k, group = 512, 128
    q, s, z = _w4(2 * inter, k, group, seed=inter)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(3)).int().to(DEVICE) \
        if with_perm else None
    x = _x(2, k, torch.bfloat16, 2)
    args = (x, q, s, z, group, perm)
    _same(w4a16_gemv(*args, block_n=8, nsb=1, gated=True), w4a16_gemv(*args, block_n=8, nsb=1))


@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K], ids=["Q4_K", "Q5_K"])
def test_kquant_gemv(inter: int, qtype: int) -> None:
    blocks = torch.from_numpy(random_blocks(qtype, 2 * inter, 2, seed=inter)).to(DEVICE)
    x = _x(2, 512, torch.float16, 4) * 0.01
    _same(kquant_gemv_triton(x, blocks, qtype, block_n=8, nsb=2, gated=True),
          kquant_gemv_triton(x, blocks, qtype, block_n=8, nsb=2))


@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("group", [256, 64], ids=["per-channel", "group64"])
def test_fp8_gemv_fma(inter: int, group: int) -> None:
    g = torch.Generator().manual_seed(inter + group)
    weight, _ = quantize_fp8_per_channel(torch.randn(2 * inter, 256, generator=g))
    scale = torch.rand(2 * inter, 256 // group, generator=g) * 0.01 + 0.001
    x = _x(1, 256, torch.bfloat16, 5)
    args = (x, weight.to(DEVICE), scale.to(DEVICE), group)
    _same(fp8_gemv_fma(*args, block_n=8, nsb=1, gated=True),
          fp8_gemv_fma(*args, block_n=8, nsb=1))


def test_odd_row_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemv_triton(_x(1, 64, torch.bfloat16, 0), torch.zeros(7, 64, dtype=torch.bfloat16,
                                                                 device=DEVICE), gated=True)


@pytest.fixture
def gemv_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The matmul entry points pick their GEMVs off CUDA too (they check `use_gemv`)."""
    def always(x: torch.Tensor, m: int, kernel: str | None) -> bool:
        return kernel != "gemm" and m <= 2

    # the modules, not
    for name in ("flotilla.kernels.w4a16", "flotilla.kernels.gguf_matmul", "flotilla.kernels.fp8"):
        monkeypatch.setattr(importlib.import_module(name), "use_gemv", always)  # kernels' names


@pytest.mark.parametrize("m", [1, 3], ids=["gemv", "gemm"])
def test_entry_points_fuse_in_the_gemv_and_fall_back_elsewhere(m: int,
                                                               gemv_everywhere: None) -> None:
    """m = 1: the GEMVs (fused); m = 3: the GEMMs, then the separate SiLU·mul kernel."""
    k = 256
    x = _x(m, k, torch.bfloat16, m)
    q, s, z = _w4(24, k, 128, seed=9)
    _same(w4a16_matmul_triton(x, q, s, z, 128, gated=True), w4a16_matmul_triton(x, q, s, z, 128))
    blocks = torch.from_numpy(random_blocks(Q4_K, 24, 1, seed=9)).to(DEVICE)
    _same(gguf_matmul_triton(x, blocks, Q4_K, gated=True), gguf_matmul_triton(x, blocks, Q4_K))
    weight, scale = quantize_fp8_per_channel(torch.randn(24, k))
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    _same(fp8_matmul_triton(x, weight, scale, gated=True), fp8_matmul_triton(x, weight, scale))


class _Spy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def test_gated_projection_goes_through_the_quant_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """SiLU on a bias-free merged gate/up layer: the method's apply_gated (the fused path);
    another activation or a bias: activation(projection)."""
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(32, [8, 8], bias=False)
    layer_tensor(layer, "weight").data.normal_()
    seen: list[tuple[int, ...]] = []
    real = layer.quant_method.apply_gated

    def spy(lyr: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return real(lyr, x)

    monkeypatch.setattr(layer.quant_method, "apply_gated", spy)
    x = torch.randn(3, 32)
    out = gated_projection(layer, SiluAndMul(), x)
    assert seen == [(3, 32)]
    torch.testing.assert_close(out, SiluAndMul()(layer(x)))
    other = _Spy()
    assert torch.equal(gated_projection(layer, other, x), layer(x)) and other.calls == 1
    with_bias = MergedColumnParallelLinear(32, [8, 8], bias=True)
    layer_tensor(with_bias, "weight").data.normal_()
    layer_tensor(with_bias, "bias").data.normal_()
    torch.testing.assert_close(gated_projection(with_bias, SiluAndMul(), x),
                               SiluAndMul()(with_bias(x)))
    assert len(seen) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w4a16", "q4k", "fp8"])
def test_gpu_llama3_gate_up(fmt: str) -> None:
    """The autotuned gated GEMVs at Llama-3-8B's gate/up size (2 x 14336 rows, K = 4096)."""
    n, k = 2 * 14336, 4096
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if fmt == "bf16":
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        _same(gemv_triton(x, w, gated=True), gemv_triton(x, w))
    elif fmt == "w4a16":
        q, s, z = _w4(n, k, 128, seed=0)
        _same(w4a16_matmul_triton(x, q, s, z, 128, gated=True),
              w4a16_matmul_triton(x, q, s, z, 128))
    elif fmt == "q4k":
        blocks = torch.from_numpy(random_blocks(Q4_K, n, k // 256, seed=0)).cuda()
        xs = x * 0.01
        _same(gguf_matmul_triton(xs, blocks, Q4_K, gated=True), gguf_matmul_triton(xs, blocks,
                                                                                   Q4_K))
    else:
        weight, scale = quantize_fp8_per_channel(torch.randn(n, k, device="cuda") / 64)
        _same(fp8_matmul_triton(x, weight, scale, gated=True), fp8_matmul_triton(x, weight, scale))
