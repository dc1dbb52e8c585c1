"""silu_and_mul kernel against its reference (and the reference against the HF gated MLP)."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
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


@pytest.mark.gpu
def test_silu_and_mul_gpu_realistic() -> None:
    x = torch.randn(2048, 2 * 14336, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x),
                               **tolerance(torch.bfloat16))
