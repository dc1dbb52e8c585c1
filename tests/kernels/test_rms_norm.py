"""RMSNorm kernels against their torch references (and the references against transformers)."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.rms_norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from tests.kernels.conftest import DEVICE, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 96), (5, 256)])
def test_rms_norm_matches_reference(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE) * 3
    w = torch.randn(hidden, dtype=dtype, device=DEVICE)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6),
                               **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_norm_and_sum(dtype: torch.dtype) -> None:
    x = torch.randn(9, 80, dtype=dtype, device=DEVICE)
    res = torch.randn(9, 80, dtype=dtype, device=DEVICE)
    w = torch.randn(80, dtype=dtype, device=DEVICE)
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))


def test_rms_norm_reads_strided_rows() -> None:
    base = torch.randn(6, 128, device=DEVICE)
    x = base[:, :64]  # row stride 128
    w = torch.randn(64, device=DEVICE)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: the fused fast path
def test_rms_norm_ref_matches_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 48, dtype=dtype)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight.data, 1e-6), norm(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_gpu_realistic(dtype: torch.dtype) -> None:
    x = torch.randn(4096, 4096, dtype=dtype, device="cuda")
    res = torch.randn_like(x)
    w = torch.randn(4096, dtype=dtype, device="cuda")
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_one_rounding_matches_reference(dtype: torch.dtype) -> None:
    """round_normed=False (gpt-oss, Gemma 4): the scale multiplies the fp32 normalised row."""
    x = torch.randn(7, 96, dtype=dtype, device=DEVICE) * 3
    res = torch.randn(7, 96, dtype=dtype, device=DEVICE)
    w = torch.randn(96, dtype=dtype, device=DEVICE)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6, round_normed=False),
                               rms_norm_ref(x, w, 1e-6, round_normed=False), **tolerance(dtype))
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-6, round_normed=False)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6, round_normed=False)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))


def test_rms_norm_ref_one_rounding_matches_transformers_gpt_oss() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    norm = GptOssRMSNorm(256, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(32, 256) * 3).bfloat16()
    with torch.no_grad():
        want = norm(x)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight.data, 1e-5, round_normed=False),
                               want, rtol=0, atol=0)
    # the llama order really rounds differently on this input (what the flag is for)
    assert not torch.equal(rms_norm_ref(x, norm.weight.data, 1e-5), want)
