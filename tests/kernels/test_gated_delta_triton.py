"""The Gated DeltaNet Triton kernels against their torch references (kernels/gated_delta_torch.py,
kernels/causal_conv1d.py), which tests/kernels/test_gated_delta.py checks against transformers.
Without CUDA they run under TRITON_INTERPRET=1 with tiny heads (where every dot is fp32: on a
GPU the exactness checks ask for "ieee" dots, and one test checks the tf32 default's error)."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.causal_conv1d import (
    causal_conv1d_update_torch,
    causal_conv1d_update_triton,
    causal_conv1d_varlen_torch,
    causal_conv1d_varlen_triton,
)
from flotilla.kernels.gated_delta_chunk import chunk_gated_delta_rule_triton, sequence_chunks
from flotilla.kernels.gated_delta_recurrent import fused_recurrent_update_triton
from flotilla.kernels.gated_delta_torch import (
    chunk_gated_delta_rule_torch,
    fused_recurrent_gated_delta_rule_update_torch,
)
from tests.kernels.conftest import DEVICE
from tests.kernels.gated_delta_cases import delta_inputs
from tests.kernels.sm90_report import needs_ptxas, sm90_report


def test_sequence_chunks_start_at_each_sequence() -> None:
    cu = torch.tensor([0, 1, 1, 65, 195], dtype=torch.int32)
    chunks = sequence_chunks(cu, 64)
    assert chunks.sequence.tolist() == [0, 2, 3, 3, 3]
    assert chunks.start.tolist() == [0, 1, 65, 129, 193]
    assert chunks.first.tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize(
    "lengths,hk,hv,dk,dv",
    [([1, 63, 64, 65, 130], 1, 2, 16, 32), ([70, 0, 5], 1, 2, 24, 48)],
)
@pytest.mark.parametrize("initial", [False, True])
def test_chunk_kernel_matches_torch(
    lengths: list[int], hk: int, hv: int, dk: int, dv: int, initial: bool
) -> None:
    inp = delta_inputs(lengths, hk, hv, dk, dv, device=DEVICE, seed=len(lengths) + initial)
    init = inp.initial_state if initial else None
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, dk**-0.5, init, inp.cu_seqlens, True)
    o, final = chunk_gated_delta_rule_triton(*args, precision="ieee")
    ref_o, ref_final = chunk_gated_delta_rule_torch(*args)
    torch.testing.assert_close(o, ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_final, atol=1e-4, rtol=1e-4)


def test_chunk_kernel_default_precision() -> None:
    inp = delta_inputs([130, 7], 2, 4, 32, 32, device=DEVICE, seed=16)
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, 32**-0.5, inp.initial_state, inp.cu_seqlens, True)
    o, final = chunk_gated_delta_rule_triton(*args)
    ref_o, ref_final = chunk_gated_delta_rule_torch(*args)
    assert float((o - ref_o).norm() / ref_o.norm()) < 5e-3
    assert float((final - ref_final).norm() / ref_final.norm()) < 5e-3


def test_chunk_kernel_bf16_without_l2norm() -> None:
    inp = delta_inputs([66, 3], 1, 2, 16, 16, dtype=torch.bfloat16, device=DEVICE, seed=11)
    inp = inp._replace(k=(torch.nn.functional.normalize(inp.k.float(), dim=-1) * 0.9).bfloat16())
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.2, inp.initial_state, inp.cu_seqlens, False)
    o, final = chunk_gated_delta_rule_triton(*args, precision="ieee")
    ref_o, ref_final = chunk_gated_delta_rule_torch(*args)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o, ref_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final, ref_final, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype,hk,hv,dk,dv", [(torch.float32, 2, 4, 16, 32), (torch.bfloat16, 1, 3, 24, 48)]
)
def test_recurrent_kernel_matches_torch(
    dtype: torch.dtype, hk: int, hv: int, dk: int, dv: int
) -> None:
    inp = delta_inputs([1] * 5, hk, hv, dk, dv, dtype=dtype, device=DEVICE, seed=12)
    pool = torch.randn(8, hv, dk, dv, device=DEVICE)
    slots = torch.tensor([6, -1, 0, 3, -1], dtype=torch.int32, device=DEVICE)
    ref_pool = pool.clone()
    o = fused_recurrent_update_triton(
        inp.q, inp.k, inp.v, inp.g, inp.beta, dk**-0.5, pool, slots, True
    )
    ref_o = fused_recurrent_gated_delta_rule_update_torch(
        inp.q, inp.k, inp.v, inp.g, inp.beta, dk**-0.5, ref_pool, slots, True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o, ref_o, atol=tol, rtol=tol)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)  # untouched rows: equal


# bf16: both paths round the conv output to bf16, then silu's (transformers' two roundings), so
# under the interpreter they agree bit for bit; a GPU's torch conv may sum in another order (or
# in TF32), one bf16 step apart
BF16_CONV_TOL = 0.0 if DEVICE == "cpu" else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_bias", [True, False])
def test_conv_varlen_kernel_matches_torch(dtype: torch.dtype, use_bias: bool) -> None:
    lengths, channels, width = [1, 2, 70, 5, 3], 40, 4
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(channels, width, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(channels, generator=gen).to(dtype).to(DEVICE) if use_bias else None
    pool = torch.randn(7, channels, width - 1, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([4, 0, 6, -1, 2], dtype=torch.int32, device=DEVICE)
    initial = torch.tensor([True, True, False, True, True], device=DEVICE)
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    ref_pool = pool.clone()
    y = causal_conv1d_varlen_triton(
        x, weight, bias, pool, slots, cu, initial, block_t=32, block_c=16
    )
    ref = causal_conv1d_varlen_torch(x, weight, bias, ref_pool, slots, cu, initial)
    tol = 1e-5 if dtype == torch.float32 else BF16_CONV_TOL
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [4, 2])
def test_conv_update_kernel_matches_torch(width: int, dtype: torch.dtype) -> None:
    channels = 40
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(4, channels, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(channels, width, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(channels, generator=gen).to(dtype).to(DEVICE)
    pool = torch.randn(6, channels, width - 1, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([5, -1, 1, 2], dtype=torch.int32, device=DEVICE)
    ref_pool = pool.clone()
    y = causal_conv1d_update_triton(x, weight, bias, pool, slots, block_c=16)
    ref = causal_conv1d_update_torch(x, weight, bias, ref_pool, slots)
    tol = 1e-5 if dtype == torch.float32 else BF16_CONV_TOL
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0)


def test_chunk_kernel_with_nearly_repeated_keys() -> None:
    """Near-identical keys, beta ~ 1, no decay: I + A is far from I (its inverse is nearly
    bidiagonal while the Neumann terms grow like binomials), the case a blocked inverse must
    still get right."""
    inp = delta_inputs([130], 1, 2, 16, 16, device=DEVICE, seed=15)
    base = torch.randn(1, 1, 16, device=DEVICE)
    keys = base + 0.01 * torch.randn(130, 1, 16, device=DEVICE)
    inp = inp._replace(k=keys, g=torch.zeros_like(inp.g), beta=torch.full_like(inp.beta, 0.99))
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.25, inp.initial_state, inp.cu_seqlens, True)
    o, final = chunk_gated_delta_rule_triton(*args, precision="ieee")
    ref_o, ref_final = chunk_gated_delta_rule_torch(*args)
    torch.testing.assert_close(o, ref_o, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(final, ref_final, atol=1e-3, rtol=1e-3)


@pytest.mark.slow
@needs_ptxas
def test_gated_delta_kernels_compile_for_sm90_without_spills() -> None:
    spills = sm90_report("tests.kernels.gated_delta_sm90", timeout=600)
    assert len(spills) == 6
    assert {name: n for name, n in spills.items() if n} == {}
