"""The tensor-core fp8 decode GEMV (kernels/fp8_gemv.py) against a float64 dequantize-then-matmul:
M = 1 and 2, per-channel and group scales, K not a multiple of the tile, split-K, bf16 rows far
outside fp16's range. On CPU the Triton interpreter runs it; the `gpu` tests run every autotune
config on the device (the interpreter cannot check the wgmma layouts or the split-K counters'
memory ordering)."""

from __future__ import annotations

import pytest
import torch
import triton

from flotilla.kernels.fp8 import fp8_matmul_triton, quantize_fp8_per_channel
from flotilla.kernels.fp8_gemv import CONFIGS, FALLBACK, fp8_gemv_mma
from flotilla.kernels.split_k import lock_buffer
from tests.quant.conftest import DEVICE, rel_err

SPLIT = triton.Config({"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 3}, num_warps=4, num_stages=3)


def make(n: int, k: int, groups: int, m: int, dtype: torch.dtype, device: str = DEVICE,
         seed: int = 0, x_scale: float = 1.0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, e4m3 weight, scales [n, groups], float64 reference y on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    weight, _ = quantize_fp8_per_channel(torch.randn(n, k, generator=g))
    scale = torch.rand(n, groups, generator=g) * 0.01 + 0.001
    x = (torch.randn(m, k, generator=g) * x_scale).to(dtype)
    ref = x.double() @ (weight.double() * scale.double().repeat_interleave(k // groups, 1)).T
    return x.to(device), weight.to(device), scale.to(device), ref


# bf16 output rounding is <= 2^-9 relative; fp16's 2^-11
TOL = {torch.bfloat16: 3e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("config", [FALLBACK, SPLIT], ids=["64x64", "split3"])
@pytest.mark.parametrize("k,groups", [(520, 1), (512, 8), (512, 4)],
                         ids=["per-channel-k520", "groups-of-64", "groups-of-128"])
@pytest.mark.parametrize("m", [1, 2])
def test_matches_dequantize_then_matmul(m: int, k: int, groups: int,
                                        config: triton.Config) -> None:
    # 72 rows: a partial (clamped) row block; K = 520: 8 tiles of 64 and a masked 8-wide one,
    # split into slices of 3 tiles (the last one short)
    x, weight, scale, ref = make(72, k, groups, m, torch.bfloat16, seed=m + groups)
    out = fp8_gemv_mma(x, weight, scale, k // groups, config)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 72)
    assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]


def test_fp16_activations() -> None:
    x, weight, scale, ref = make(40, 520, 1, 2, torch.float16, seed=3)
    out = fp8_gemv_mma(x, weight, scale, 520, SPLIT)
    assert out.dtype == torch.float16
    assert rel_err(out.cpu(), ref) < TOL[torch.float16]


def test_bf16_rows_beyond_fp16_range() -> None:
    """Row 0 peaks near 3e6 (fp16 overflows at 65504), row 1 is ~1e-4: each row is scaled by
    its own max before the fp16 dot, so both keep bf16 accuracy."""
    x, weight, scale, _ = make(64, 256, 1, 2, torch.bfloat16, seed=4)
    x = x.cpu().double()
    x[0] *= 1e5
    x[0, 7] = 3e6
    x[1] *= 1e-4
    x = x.to(torch.bfloat16)
    ref = x.double() @ (weight.double().cpu() * scale.double().cpu()).T
    out = fp8_gemv_mma(x.to(DEVICE), weight, scale, 256).cpu()
    assert torch.isfinite(out).all()
    for row in range(2):
        assert rel_err(out[row], ref[row]) < TOL[torch.bfloat16]


def test_split_k_counters_return_to_zero() -> None:
    x, weight, scale, ref = make(300, 512, 4, 2, torch.bfloat16, seed=5)
    first = fp8_gemv_mma(x, weight, scale, 128, SPLIT)
    locks = lock_buffer(x.device)
    assert int(locks.abs().sum()) == 0
    second = fp8_gemv_mma(x, weight, scale, 128, SPLIT)  # a stale counter would skip the sum
    assert torch.equal(first, second)
    assert rel_err(second.cpu(), ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("groups", [1, 4, 13], ids=["per-channel", "groups-of-128", "groups-of-40"])
def test_decode_dispatch(groups: int) -> None:
    """fp8_matmul_triton with kernel="gemv" on two rows: the tensor-core GEMV for 16-bit x and
    groups of 64k, the GEMM where no GEMV takes the shape (K = 520, groups of 40); both against
    the reference (tests/quant/test_fp8_gemv_fma.py has the dispatch by row count)."""
    x, weight, scale, ref = make(24, 520, groups, 2, torch.bfloat16, seed=6)
    out = fp8_matmul_triton(x, weight, scale, kernel="gemv")
    assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k,groups", [(4160, 1), (4096, 32)], ids=["per-channel", "groups-of-128"])
@pytest.mark.parametrize("config", [*CONFIGS, FALLBACK],
                         ids=lambda c: "_".join(str(v) for v in c.kwargs.values())
                         + f"_w{c.num_warps}_s{c.num_stages}")
def test_gpu_every_config(config: triton.Config, k: int, groups: int, m: int) -> None:
    if groups > 1 and (k // groups) % config.kwargs["BLOCK_K"]:
        pytest.skip("BLOCK_K must divide the group")
    # |x| up to ~1.5e5: past fp16's range unless the kernel scales the rows
    x, weight, scale, ref = make(1000, k, groups, m, torch.bfloat16, device="cuda", seed=m,
                                 x_scale=3e4)
    out = fp8_gemv_mma(x, weight, scale, k // groups, config)
    assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]
    assert int(lock_buffer(x.device).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_gpu_autotuned_llama_shapes(n: int, k: int, m: int) -> None:
    for groups in (1, k // 128):
        x, weight, scale, ref = make(n, k, groups, m, torch.bfloat16, device="cuda", seed=n)
        out = fp8_matmul_triton(x, weight, scale)
        assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]
