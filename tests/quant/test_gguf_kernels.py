"""GGUF block decoding and the quantized matmul kernels against gguf.quants (the reference).

Weights are random block bytes (every bit pattern of codes and sub-block scales occurs) with the
f16 super-scales set to small finite values, so the layout check does not depend on our quantizer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from flotilla.kernels.gguf_dequant import GGUF_TYPES, Q4_K, Q5_K, dequantize_ref
from flotilla.kernels.gguf_kquant_gemv import kquant_gemv_triton
from flotilla.kernels.gguf_matmul import gguf_matmul_ref, gguf_matmul_triton
from tests.quant.conftest import DEVICE, rel_err

# byte offsets of the f16 fields of each block
_F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ4_NL": [0], "IQ4_XS": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0],
               "IQ3_XXS": [0], "IQ3_S": [0]}
QTYPES = sorted(GGUF_TYPES)
TYPE_IDS = [GGUF_TYPES[q].name for q in QTYPES]


def random_blocks(qtype: int, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    t = GGUF_TYPES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, blocks, t.type_size), dtype=np.uint8)
    for off in _F16_FIELDS[t.name]:
        scale = rng.uniform(-0.02, 0.02, size=(rows, blocks)).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * t.type_size)


def gguf_reference(blocks: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType(qtype)).astype(np.float32))


@pytest.mark.parametrize("qtype", QTYPES, ids=TYPE_IDS)
def test_torch_dequantizer_matches_gguf_quants(qtype: int) -> None:
    blocks = random_blocks(qtype, 3, 4)
    ours = dequantize_ref(torch.from_numpy(blocks), qtype)
    torch.testing.assert_close(ours, gguf_reference(blocks, qtype), rtol=0, atol=0)


CASES = [  # (kernel, M, launcher overrides)
    ("gemv", 2, {}),  # Q4_K / Q5_K: kernels/gguf_kquant_gemv.py
    ("gemv", 1, {"block_n": 8}),  # the generic GEMV for every type
    ("gemm", 7, {}),
    ("gemm", 33, {"block_m": 16, "block_n": 16, "split_k": 2}),  # several tiles, split K
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel,m,overrides", CASES, ids=[f"{c[0]}-m{c[1]}" for c in CASES])
@pytest.mark.parametrize("qtype", QTYPES, ids=TYPE_IDS)
def test_triton_matmul_matches_dequantize_then_matmul(
    qtype: int, kernel: str, m: int, overrides: dict, dtype: torch.dtype
) -> None:
    t = GGUF_TYPES[qtype]
    n, nblocks = 20, (3 if t.qk == 256 else 5)  # ragged rows and block chunks
    blocks = random_blocks(qtype, n, nblocks, seed=qtype)
    w = gguf_reference(blocks, qtype).double()
    x = torch.randn(m, nblocks * t.qk, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.double() @ w.T
    qweight = torch.from_numpy(blocks).to(DEVICE)
    out = gguf_matmul_triton(x.to(DEVICE), qweight, qtype, kernel=kernel, **overrides)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_matmul_rejects_mismatched_features() -> None:
    blocks = torch.from_numpy(random_blocks(12, 4, 1))
    with pytest.raises(ValueError, match="features"):
        gguf_matmul_triton(torch.randn(1, 128), blocks, 12)


KQUANT_GEMV_CASES = [  # (N, blocks, M, block_n, nsb, prefetch)
    (20, 3, 1, 8, 2, False),  # ragged rows (2.5 tiles) and blocks (1.5 steps)
    (9, 8, 2, 4, 4, True),  # two x rows; each step's loads issued during the one before
    (5, 5, 2, 16, 8, True),  # one partial step; most rows of the tile past N
]
# x as the kernel reads it: bf16 / fp16 rows as int32 pairs; bf16 rows of odd stride and fp32
# element by element
X_KINDS = {"bf16": (torch.bfloat16, 0, 1e-2), "bf16-stride": (torch.bfloat16, 1, 1e-2),
           "fp16": (torch.float16, 0, 1e-3), "fp32": (torch.float32, 0, 1e-5)}


@pytest.mark.parametrize("x_kind", list(X_KINDS))
@pytest.mark.parametrize("case", KQUANT_GEMV_CASES,
                         ids=[f"n{n}-b{b}-m{m}-bn{bn}-nsb{s}" for n, b, m, bn, s, _ in
                              KQUANT_GEMV_CASES])
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K], ids=["Q4_K", "Q5_K"])
def test_kquant_gemv_matches_gguf_dequantize(qtype: int, case: tuple, x_kind: str) -> None:
    """kernels/gguf_kquant_gemv.py with pinned tiles (the autotuned path: the GPU test below)."""
    n, nblocks, m, block_n, nsb, prefetch = case
    dtype, pad, tol = X_KINDS[x_kind]
    blocks = random_blocks(qtype, n, nblocks, seed=n)
    w = gguf_reference(blocks, qtype).double()
    k = nblocks * 256
    wide = torch.randn(m, k + pad, generator=torch.Generator().manual_seed(m)).to(dtype)
    x = wide.to(DEVICE)[:, :k]
    out = kquant_gemv_triton(x, torch.from_numpy(blocks).to(DEVICE), qtype, block_n=block_n,
                             nsb=nsb, prefetch=prefetch)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out.cpu(), wide[:, :k].double() @ w.T) < tol


KQUANT_GEMM_CASES = [  # (M, N, blocks, launcher overrides)
    (3, 37, 1, {}),  # one program: every row and column in one tile
    (16, 20, 3, {"block_m": 16, "block_n": 16}),  # N = 1.25 tiles
    (40, 50, 5, {"block_m": 32, "block_n": 32, "split_k": 2}),  # ragged M, split K
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", KQUANT_GEMM_CASES,
                         ids=[f"m{m}-n{n}-b{b}" for m, n, b, _ in KQUANT_GEMM_CASES])
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K], ids=["Q4_K", "Q5_K"])
def test_kquant_gemm_matches_gguf_dequantize(qtype: int, case: tuple, dtype: torch.dtype,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/gguf_kquant_gemm.py (forced under the interpreter by kernel="gemm") against
    gguf.quants' dequantize, then a float64 matmul."""
    import sys

    matmul = sys.modules["flotilla.kernels.gguf_matmul"]
    launches = []
    launch = matmul.kquant_gemm_launch
    monkeypatch.setattr(matmul, "kquant_gemm_launch",
                        lambda *a, **k: launches.append(a[4:7]) or launch(*a, **k))
    m, n, nblocks, overrides = case
    blocks = random_blocks(qtype, n, nblocks, seed=m)
    w = gguf_reference(blocks, qtype).double()
    x = torch.randn(m, nblocks * 256, generator=torch.Generator().manual_seed(n)).to(dtype)
    out = gguf_matmul_triton(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), qtype,
                             kernel="gemm", **overrides)
    # the k-quant GEMM ran, not the generic one (on CUDA it takes 16-bit x only: fp32 x goes
    # to the generic kernel, kquant_gemm_ok)
    assert len(launches) == int(not (x.to(DEVICE).is_cuda and dtype == torch.float32))
    assert out.shape == (m, n) and out.dtype == dtype
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    assert rel_err(out.cpu(), x.double() @ w.T) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 16, 64, 300])
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K], ids=["Q4_K", "Q5_K"])
def test_gpu_kquant_gemm_llama3_shapes(qtype: int, m: int) -> None:
    """The default (CUDA) path for M > GEMV_MAX_M at Llama-3-8B's projections: qkv, o,
    gate_up, down (K = 14336)."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        qweight = torch.from_numpy(random_blocks(qtype, n, k // 256, seed=n)).cuda()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ dequantize_ref(qweight, qtype).double().T
        assert rel_err(gguf_matmul_triton(x, qweight, qtype), ref) < 1e-2, (n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K], ids=["Q4_K", "Q5_K"])
def test_gpu_kquant_gemv_every_autotune_config(qtype: int) -> None:
    """Each tile the autotuner may pick (inline-PTX loads and codes), on ragged rows (100) and
    blocks (9: partial steps for NSB 8 and 16)."""
    from flotilla.kernels import gguf_kquant_gemv

    n, nblocks, m = 100, 9, 2
    blocks = random_blocks(qtype, n, nblocks, seed=3)
    x = torch.randn(m, nblocks * 256, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ gguf_reference(blocks, qtype).double().cuda().T
    qweight = torch.from_numpy(blocks).cuda()
    configs = gguf_kquant_gemv.GEMV_CONFIGS if qtype == Q4_K else gguf_kquant_gemv.GEMV_CONFIGS_Q5
    for c in configs:
        out = kquant_gemv_triton(x, qweight, qtype, block_n=c.kwargs["BLOCK_N"],
                                 nsb=c.kwargs["NSB"], prefetch=c.kwargs["PREFETCH"],
                                 num_warps=c.num_warps)
        assert rel_err(out, ref) < 1e-2, c


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 128])
@pytest.mark.parametrize("qtype", QTYPES, ids=TYPE_IDS)
def test_gpu_matmul_real_sizes(qtype: int, m: int) -> None:
    t = GGUF_TYPES[qtype]
    n, k = 4096, 4096 if t.qk == 32 else 14336
    qweight = torch.from_numpy(random_blocks(qtype, n, k // t.qk)).cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ dequantize_ref(qweight, qtype).double().T
    assert rel_err(gguf_matmul_triton(x, qweight, qtype), ref) < 1e-2
    assert rel_err(gguf_matmul_ref(x, qweight, qtype), ref) < 1e-2
