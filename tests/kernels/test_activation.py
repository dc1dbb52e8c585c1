"""silu_and_mul and gpt-oss's clamped SwiGLU kernels against their references (and the
references against the HF formulas)."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.activation import (
    SwigluOAI,
    silu_and_mul_ref,
    silu_and_mul_triton,
    swiglu_oai_ref,
    swiglu_oai_triton,
)
from tests.kernels.conftest import DEVICE, tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 32), (5, 100), (3, 1500)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, tokens: int, inter: int) -> None:
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=DEVICE) * 4
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **tolerance(dtype))


def test_silu_and_mul_ref_is_gate_times_up() -> None:
    gate, up = torch.randn(4, 24), torch.randn(4, 24)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(torch.cat([gate, up], -1)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 32), (5, 100)])
def test_swiglu_oai_matches_reference(dtype: torch.dtype, tokens: int, inter: int) -> None:
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=DEVICE) * 4  # past the clamp
    act = SwigluOAI(alpha=1.702, limit=3.0)
    torch.testing.assert_close(swiglu_oai_triton(x, act), swiglu_oai_ref(x, act),
                               **tolerance(dtype))


def test_swiglu_oai_ref_is_gpt_oss_gate() -> None:
    """transformers' GptOssExperts._apply_gate on interleaved columns, ours on halves."""
    gate, up = torch.randn(4, 24) * 5, torch.randn(4, 24) * 5
    g, u = gate.clamp(max=7.0), up.clamp(min=-7.0, max=7.0)
    expected = (u + 1) * (g * torch.sigmoid(g * 1.702))
    torch.testing.assert_close(swiglu_oai_ref(torch.cat([gate, up], -1), SwigluOAI()), expected)


@pytest.mark.gpu
def test_silu_and_mul_gpu_realistic() -> None:
    x = torch.randn(2048, 2 * 14336, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x),
                               **tolerance(torch.bfloat16))
