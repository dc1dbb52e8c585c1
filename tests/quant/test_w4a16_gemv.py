"""The tensor-core 4-bit decode GEMV (kernels/w4a16_gemv.py) against a float64
dequantize-then-matmul (w4a16_dequantize_ref): M = 1 and 2, groups of 32 / 64 / 128 and
per-channel, act-order perm, K with a partial tile, split-K, bf16 rows far outside fp16's range,
zero points 0..16. On CPU the Triton interpreter runs the plain-Triton code path; the `gpu` tests
run the inline asm and every autotune config on the device (the interpreter cannot check the
wgmma layouts or the split-K counters' memory ordering)."""

from __future__ import annotations

import pytest
import torch
import triton

from kernels import w4a16_gemv
from kernels.w4a16 import pack_int4, w4a16_dequantize_ref, w4a16_matmul_triton
from kernels.w4a16_gemv import CONFIGS, FALLBACK, w4a16_gemv_mma
from tests.quant.conftest import DEVICE, rel_err

SPLIT = triton.Config({"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 3}, num_warps=4, num_stages=3)
WIDE = triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1}, num_warps=4, num_stages=3)
# bf16 output rounding is <= 2^-9 relative; fp16's 2^-11
TOL = {torch.bfloat16: 3e-3, torch.float16: 1e-3}


def make(n: int, k: int, group: int, m: int, dtype: torch.dtype, perm: bool,
         device: str = DEVICE, seed: int = 0, x_scale: float = 1.0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                    torch.Tensor]:
    """(x, qweight, scales, zeros, perm or None, float64 reference y on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8, generator=g)
    order = torch.randperm(k, generator=g).int() if perm else None
    x = (torch.randn(m, k, generator=g) * x_scale).to(dtype)
    qweight = pack_int4(codes)
    w = w4a16_dequantize_ref(qweight, scales, zeros, group).double()
    ref = (x.double() if order is None else x.double()[:, order.long()]) @ w.T
    return (x.to(device), qweight.to(device), scales.to(device), zeros.to(device),
            None if order is None else order.to(device), ref)


@pytest.mark.parametrize("config", [FALLBACK, SPLIT], ids=["64x32", "split3"])
@pytest.mark.parametrize("k,group", [(264, 264), (256, 32), (256, 64), (512, 128)],
                         ids=["per-channel-k264", "g32", "g64", "g128"])
@pytest.mark.parametrize("perm", [False, True], ids=["plain", "perm"])
@pytest.mark.parametrize("m", [1, 2])
def test_matches_dequantize_then_matmul(m: int, perm: bool, k: int, group: int,
                                        config: triton.Config) -> None:
    # 72 rows: a partial (clamped) row block; K = 264: 8 tiles of 32 and a masked 8-wide one,
    # split into slices of 3 tiles (the last one short)
    x, q, s, z, order, ref = make(72, k, group, m, torch.bfloat16, perm, seed=m + group)
    out = w4a16_gemv_mma(x, q, s, z, group, order, config)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 72)
    assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("group", [64, 128])
def test_tile_of_two_dot_blocks(group: int) -> None:
    """BLOCK_K = 64: two 32-wide quarters of words per thread row (u = 0, 1 of the K order)."""
    x, q, s, z, order, ref = make(40, 512, group, 2, torch.bfloat16, True, seed=group)
    out = w4a16_gemv_mma(x, q, s, z, group, order, WIDE)
    assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("group", [64, 264])
def test_fp16_activations(group: int) -> None:
    k = 264 if group == 264 else 512
    x, q, s, z, order, ref = make(40, k, group, 2, torch.float16, False, seed=3)
    out = w4a16_gemv_mma(x, q, s, z, group, order, SPLIT)
    assert out.dtype == torch.float16
    assert rel_err(out.cpu(), ref) < TOL[torch.float16]


def test_bf16_rows_beyond_fp16_range() -> None:
    """Row 0 peaks near 3e6 (fp16 overflows at 65504), row 1 is ~1e-4: bf16 x meets bf16
    weights (128 + code) in the dot, so both rows keep bf16 accuracy."""
    x, q, s, z, _, _ = make(64, 256, 64, 2, torch.bfloat16, False, seed=4)
    x = x.cpu().double()
    x[0] *= 1e5
    x[0, 7] = 3e6
    x[1] *= 1e-4
    x = x.to(torch.bfloat16)
    ref = x.double() @ w4a16_dequantize_ref(q.cpu(), s.cpu(), z.cpu(), 64).double().T
    out = w4a16_gemv_mma(x.to(DEVICE), q, s, z, 64).cpu()
    assert torch.isfinite(out).all()
    for row in range(2):
        assert rel_err(out[row], ref[row]) < TOL[torch.bfloat16]


def test_split_k_counters_return_to_zero() -> None:
    x, q, s, z, order, ref = make(200, 512, 128, 2, torch.bfloat16, False, seed=5)
    first = w4a16_gemv_mma(x, q, s, z, 128, order, SPLIT)
    assert int(w4a16_gemv._lock_buffer(x.device).abs().sum()) == 0
    second = w4a16_gemv_mma(x, q, s, z, 128, order, SPLIT)  # a stale counter skips the sum
    assert torch.equal(first, second)
    assert rel_err(second.cpu(), ref) < TOL[torch.bfloat16]


def test_dispatch() -> None:
    """w4a16_matmul_triton(kernel="mma") runs it (CUDA's default for M <= 2, 16-bit x and
    groups of 64k or per-channel; groups of 32 keep the faster CUDA-core GEMV there); groups
    that are not multiples of 32 are refused."""
    x, q, s, z, order, ref = make(24, 384, 128, 2, torch.bfloat16, True, seed=6)
    out = w4a16_matmul_triton(x[:, None], q, s, z, 128, order, kernel="mma")
    assert out.shape == (2, 1, 24)
    assert rel_err(out[:, 0].cpu(), ref) < TOL[torch.bfloat16]
    assert not w4a16_gemv.w4_mma_ok(x, 384, 48) and w4a16_gemv.w4_mma_ok(x, 384, 384)
    assert not w4a16_gemv.w4_mma_ok(x, 384, 32) and w4a16_gemv.w4_mma_ok(x, 384, 64)
    with pytest.raises(ValueError):
        w4a16_gemv_mma(x, q, s, z, 48)


def test_autotune_prune_reads_constexprs_as_triton_passes_them() -> None:
    """Triton's autotuner calls early_config_prune(configs, positional args, **constexprs):
    GROUP arrives as a keyword (an H100 run failed with KeyError before)."""
    named = {"N": 4096, "K": 4096}
    g128 = w4a16_gemv._prune(CONFIGS, named, GROUP=128, HAS_PERM=False)
    assert g128 and all(128 % c.kwargs["BLOCK_K"] == 0 for c in g128)
    per_channel = w4a16_gemv._prune(CONFIGS, named, GROUP=4096, HAS_PERM=False)
    assert len(per_channel) >= len(g128)


def _config_id(c: triton.Config) -> str:
    return "_".join(str(v) for v in c.kwargs.values()) + f"_w{c.num_warps}_s{c.num_stages}"


# (K, group, x dtype, M, perm): per-channel with a partial tile, groups of 128 both ways, groups
# of 32 (FALLBACK only) in fp16
GPU_CASES = [(4160, 4160, torch.bfloat16, 2, True), (4096, 128, torch.bfloat16, 1, False),
             (4096, 128, torch.bfloat16, 2, True), (4096, 128, torch.float16, 2, False),
             (4096, 32, torch.float16, 1, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("k,group,dtype,m,perm", GPU_CASES,
                         ids=["per-channel", "g128-m1", "g128-perm", "g128-fp16", "g32-fp16"])
@pytest.mark.parametrize("config", [*CONFIGS, FALLBACK], ids=_config_id)
def test_gpu_every_config(config: triton.Config, k: int, group: int, dtype: torch.dtype,
                          m: int, perm: bool) -> None:
    bk = config.kwargs["BLOCK_K"]
    if (group != k and group % bk) or (k % bk and bk > 128):
        pytest.skip("BLOCK_K must divide the group (a partial tile: BLOCK_K <= 128)")
    x, q, s, z, order, ref = make(1000, k, group, m, dtype, perm, device="cuda", seed=m,
                                  x_scale=1e3 if dtype == torch.bfloat16 else 1.0)
    out = w4a16_gemv_mma(x, q, s, z, group, order, config)
    assert rel_err(out.cpu(), ref) < TOL[dtype]
    assert int(w4a16_gemv._lock_buffer(x.device).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_gpu_autotuned_llama_shapes(n: int, k: int, m: int) -> None:
    for perm in (False, True):
        x, q, s, z, order, ref = make(n, k, 128, m, torch.bfloat16, perm, device="cuda", seed=n)
        out = w4a16_matmul_triton(x, q, s, z, 128, order)  # the default CUDA path
        assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]
