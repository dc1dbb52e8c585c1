"""The re-packed ("Marlin-style") 4-bit layout, kernels/w4a16_marlin.py: the load-time re-pack
(round trip and the documented placement), its tensor-core GEMM and the batch-1 GEMV reading
the same layout, against dequantize-then-matmul in float64 (GPTQ symmetric / asymmetric, group
sizes, act-order, AWQ zero points), and its inline PTX against the interpreter form."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flotilla.kernels.w4a16 import pack_int4, w4a16_dequantize_ref, w4a16_matmul_triton
from flotilla.kernels.w4a16_gemv import w4a16_gemv
from flotilla.kernels.w4a16_marlin import (
    DEQ_BF16,
    DEQ_F16,
    marlin_order,
    marlin_pack,
    marlin_unpack,
    w4a16_marlin,
)
from tests.kernels.ptx_emulator import run_ptx
from tests.quant.conftest import DEVICE, rel_err


def _case(n: int, k: int, group: int, seed: int, zeros: str, act_order: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """codes [N, K], scales, zeros ("sym": GPTQ's 8, "asym": random, as AWQ / asymmetric
    GPTQ), perm (act-order) in kernel order."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    z = (torch.full((n, k // group), 8, dtype=torch.uint8) if zeros == "sym"
         else torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=g))
    perm = torch.randperm(k, generator=g).int() if act_order else None
    return codes, scales, z, perm


def _reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group: int, perm: torch.Tensor | None) -> torch.Tensor:
    w = w4a16_dequantize_ref(pack_int4(codes), scales, zeros, group).double()
    return (x.double() if perm is None else x.double()[:, perm.long()]) @ w.T


def test_repack_round_trip_and_placement() -> None:
    """marlin_unpack inverts marlin_pack, and word w of each 64-weight block holds weight
    16 j + 2 w + h in nibble j + 4 h (the placement the GEMM's dequantization relies on)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 192), dtype=torch.uint8, generator=g)
    packed = marlin_pack(codes)
    assert packed.shape == (6, 24) and packed.dtype == torch.int32
    assert torch.equal(marlin_unpack(packed), codes)
    words = packed.numpy().astype(np.int64) & 0xFFFFFFFF
    for b in range(3):
        for w in range(8):
            for j in range(4):
                for h in range(2):
                    nib = (words[:, 8 * b + w] >> (4 * (j + 4 * h))) & 15
                    np.testing.assert_array_equal(nib, codes[:, 64 * b + 16 * j + 2 * w + h])
    assert sorted(marlin_order(128).tolist()) == list(range(128))
    with pytest.raises(ValueError, match="K % 64"):
        marlin_pack(codes[:, :96])


@pytest.mark.parametrize("m,k,group,config", [
    (2, 256, 64, {}),  # two rows padded to a 16-row tile; a group a step
    (2, 256, 64, {"SWAP": False}),  # x rows as the MMA's M
    (5, 512, 128, {"BLOCK_K": 128, "SPLIT_K": 2}),  # split-K finished in the launch
    (5, 512, 128, {"BLOCK_K": 128, "SPLIT_K": 2, "SWAP": False}),
    (16, 512, 256, {"BLOCK_K": 256, "BLOCK_N": 32}),  # rows past N clamped, never stored
    (37, 256, 128, {"BLOCK_K": 64, "SPLIT_K": 4}),  # several steps a group
    (3, 384, 384, {"BLOCK_K": 128, "SPLIT_K": 3}),  # one group per row (per-channel)
    (70, 128, 64, {}),  # more rows than one 64-row tile (prefill)
])
@pytest.mark.parametrize("zeros", ["sym", "asym"])
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "actorder"])
def test_marlin_gemm_matches_reference(m: int, k: int, group: int, config: dict, zeros: str,
                                       act_order: bool) -> None:
    codes, scales, z, perm = _case(40, k, group, m + k + group, zeros, act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = _reference(x, codes, scales, z, group, perm)
    q = marlin_pack(codes).to(DEVICE)
    p = None if perm is None else perm.to(DEVICE)
    out = w4a16_marlin(x.to(DEVICE), q, scales.to(DEVICE), z.to(DEVICE), group, p, config=config)
    assert out.shape == (m, 40)
    assert rel_err(out.cpu().double(), ref) < 1e-5
    # the dispatcher takes the re-packed layout for every row count (one row: the GEMV)
    for rows in (1, m):
        out = w4a16_matmul_triton(x[:rows].to(DEVICE), q, scales.to(DEVICE), z.to(DEVICE), group, p,
                                  marlin=True)
        assert rel_err(out.cpu().double(), ref[:rows]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_marlin_gemm_16bit_activations(dtype: torch.dtype) -> None:
    """16-bit x: the planes are dequantized in x's dtype ((code - zero) exact) and the group
    scale applied to the fp32 sums."""
    codes, scales, z, _ = _case(24, 256, 128, 1, "asym", False)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = _reference(x.float(), codes, scales, z, 128, None)
    out = w4a16_marlin(x.to(DEVICE), marlin_pack(codes).to(DEVICE), scales.to(DEVICE),
                       z.to(DEVICE), 128, None, config={"BLOCK_K": 128})
    assert out.dtype == dtype and rel_err(out.cpu().double(), ref) < 1e-2


@pytest.mark.parametrize("k,group,nsb", [(512, 128, 2), (320, 64, 1), (448, 448, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "actorder"])
def test_marlin_gemv_matches_reference(k: int, group: int, nsb: int, dtype: torch.dtype,
                                       act_order: bool) -> None:
    """The batch-1 GEMV over the re-packed words: each word's x values are the four pairs
    16 apart its nibbles hold (x read as int32 pairs for 16-bit x, gathered under act-order)."""
    codes, scales, z, perm = _case(24, k, group, k + nsb, "asym", act_order)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    ref = _reference(x.float(), codes, scales, z, group, perm)
    out = w4a16_gemv(x.to(DEVICE), marlin_pack(codes).to(DEVICE), scales.to(DEVICE), z.to(DEVICE),
                     group, None if perm is None else perm.to(DEVICE), block_n=8, nsb=nsb,
                     marlin=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out.cpu().double(), ref) < tol


def test_marlin_gated_through_dispatcher() -> None:
    """gated: silu(gate) * up over the re-packed [gate; up] rows, GEMV (one row) and GEMM."""
    codes, scales, z, _ = _case(32, 128, 64, 5, "sym", False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    full = _reference(x, codes, scales, z, 64, None)
    ref = torch.nn.functional.silu(full[:, :16]) * full[:, 16:]
    for rows in (1, 3):
        out = w4a16_matmul_triton(x[:rows].to(DEVICE), marlin_pack(codes).to(DEVICE),
                                  scales.to(DEVICE), z.to(DEVICE), 64, marlin=True, gated=True)
        assert rel_err(out.cpu().double(), ref[:rows]) < 1e-5


@pytest.mark.parametrize("asm,bf16", [(DEQ_BF16, True), (DEQ_F16, False)], ids=["bf16", "f16"])
def test_dequant_asm_matches_interpreter_form(asm: object, bf16: bool) -> None:
    """The LOP3 magic-number block: plane j of a word is (nibble j, nibble j + 4) as 16-bit
    floats minus the zero, (code - zero) exactly, as dequant_planes' interpreter form."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**32, size=2048, dtype=np.uint64).astype(np.uint32)
    q[:2] = [0, 0xFFFFFFFF]
    z = rng.integers(0, 16, size=2048).astype(np.uint32)
    magic = 0x4300 if bf16 else 0x6400
    zz = (z | magic) * np.uint32(65537)
    out = run_ptx(asm.value, {4: q, 5: q, 6: zz, 7: zz})  # type: ignore[attr-defined]
    assert sorted(out) == [0, 1, 2, 3]
    for j in range(4):
        lo, hi = (out[j] & np.uint32(0xFFFF)), out[j] >> np.uint32(16)
        for half, nib in ((lo, j), (hi, j + 4)):
            if bf16:
                got = (half << np.uint32(16)).view(np.float32).astype(np.float64)
            else:
                got = half.astype(np.uint16).view(np.float16).astype(np.float64)
            code = (q >> np.uint32(4 * nib)) & np.uint32(15)
            np.testing.assert_array_equal(got, code.astype(np.float64) - z)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_marlin_real_sizes(m: int, dtype: torch.dtype) -> None:
    """Llama-3-8B's down_proj shape on a GPU (inline PTX, autotuned tiles, wgmma): the GEMV
    (one row), the autotuned GEMM (2..64) and the prefill tile (300), plain and act-order."""
    n, k, group = 4096, 14336, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // group, device="cuda") * 0.01).half()
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8, device="cuda")
    q = marlin_pack(codes)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = w4a16_dequantize_ref(pack_int4(codes), scales, zeros, group).double()
    for perm in (None, torch.randperm(k, device="cuda").int()):
        ref = (x.double() if perm is None else x.double()[:, perm.long()]) @ w.T
        out = w4a16_matmul_triton(x, q, scales, zeros, group, perm, marlin=True)
        assert rel_err(out, ref) < 1e-2
