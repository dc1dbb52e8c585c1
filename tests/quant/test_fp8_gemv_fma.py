"""The CUDA-core fp8 decode GEMV (kernels/fp8_gemv_fma.py) against a float64 dequantize-then-
matmul: its tiles (rows past N, steps past K, prefetch), per-channel and group scales, bf16 /
fp16 x as vectors of pairs and fp32 x element by element, every e4m3 value (subnormals, signs,
the largest). The interpreter runs the plain forms of the asm; the `gpu` test runs the tuned
kernel at Llama-3-8B sizes."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.fp8 import FP8, quantize_fp8_per_channel
from flotilla.kernels.fp8_gemv_fma import fma_gemv_ok, fp8_gemv_fma
from flotilla.kernels.selection import KernelSelection
from tests.quant.conftest import DEVICE, rel_err

TOL = {torch.bfloat16: 3e-3, torch.float16: 1e-3, torch.float32: 1e-6}


def make(n: int, k: int, group: int, m: int, dtype: torch.dtype, seed: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight, _ = quantize_fp8_per_channel(torch.randn(n, k, generator=g))
    scale = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    x = torch.randn(m, k, generator=g).to(dtype)
    ref = x.double() @ (weight.double() * scale.double().repeat_interleave(group, 1)).T
    return x, weight, scale, ref


@pytest.mark.parametrize("k,group,nsb,prefetch", [
    (512, 512, 2, False),  # per channel, K a multiple of 128 * NSB
    (512, 64, 1, True),  # groups of 64, next step loaded ahead
    (416, 416, 2, False),  # per channel, the last step's runs past K clamped
    (416, 32, 2, True),  # groups of 32, ragged steps with prefetch
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_dequantize_then_matmul(k: int, group: int, nsb: int, prefetch: bool,
                                        dtype: torch.dtype) -> None:
    x, weight, scale, ref = make(13, k, group, 2, dtype, seed=k + group + nsb)
    assert fma_gemv_ok(x, weight, group)
    out = fp8_gemv_fma(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), group, block_n=8,
                       nsb=nsb, prefetch=prefetch)
    assert out.dtype == dtype and out.shape == (2, 13)
    assert rel_err(out.cpu().double(), ref) < TOL[dtype]


def test_every_e4m3_value() -> None:
    """Row i holds e4m3 code i (all 256 but the two NaNs) at one position and zeros elsewhere, so
    each output is that code's value times x there: the byte order and the conversion of every
    code (subnormals, negative zero, +-448) are checked exactly."""
    codes = [c for c in range(256) if c not in (0x7F, 0xFF)]
    n, k = len(codes), 64
    bits = torch.zeros(n, k, dtype=torch.uint8)
    pos = torch.arange(n) * 7 % k
    bits[torch.arange(n), pos] = torch.tensor(codes, dtype=torch.uint8)
    weight = bits.view(FP8)
    x = torch.zeros(1, k, dtype=torch.float32)
    x[0] = torch.arange(1, k + 1, dtype=torch.float32)
    scale = torch.ones(n, 1)
    out = fp8_gemv_fma(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), k, block_n=8, nsb=1)
    expect = weight.float()[torch.arange(n), pos] * x[0, pos]
    assert torch.equal(out.cpu()[0], expect)


def test_unsupported_shapes_are_refused() -> None:
    x = torch.zeros(1, 48)
    w = torch.zeros(4, 48, dtype=FP8)
    assert not fma_gemv_ok(x, w, 48)  # K not a multiple of 32
    assert not fma_gemv_ok(torch.zeros(1, 64), torch.zeros(4, 64, dtype=FP8), 16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", [(6144, 4096, 4096), (4096, 14336, 14336),
                                       (4096, 4096, 128)])
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_real_sizes(n: int, k: int, group: int, m: int) -> None:
    x, weight, scale, ref = make(n, k, group, m, torch.bfloat16, seed=m)
    out = fp8_gemv_fma(x.cuda(), weight.cuda(), scale.cuda(), group)
    assert rel_err(out.cpu().double(), ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("kind,m,expect", [("auto", 1, "fma"), ("auto", 2, "mma"),
                                           ("auto", 3, "fma"), ("mma", 1, "mma"),
                                           ("fma", 2, "fma")])
def test_decode_dispatch(kind: str, m: int, expect: str, monkeypatch: pytest.MonkeyPatch
                         ) -> None:
    """kernels/fp8.py's GEMV choice: one row on the CUDA cores, two on the tensor cores (which
    read W once for both), more on the CUDA cores; the selection's fp8_gemv (FLOTILLA_FP8_GEMV)
    pins one."""
    from flotilla.kernels import fp8

    calls: list[str] = []
    def fake(kind: str):  # type: ignore[no-untyped-def]
        return lambda x2, w, *a, **kw: calls.append(kind) or x2.new_zeros(x2.shape[0], w.shape[0])

    monkeypatch.setattr(fp8, "fp8_gemv_fma", fake("fma"))
    monkeypatch.setattr(fp8, "fp8_gemv_mma", fake("mma"))
    x, weight, scale, _ = make(8, 64, 64, m, torch.bfloat16, seed=0)
    fp8.fp8_matmul_triton(x, weight, scale, kernel="gemv", fp8_gemv=kind)
    assert calls == [expect]
    with pytest.raises(ValueError, match="fp8_gemv must be one of"):
        KernelSelection(fp8_gemv="cublas")  # type: ignore[arg-type]
