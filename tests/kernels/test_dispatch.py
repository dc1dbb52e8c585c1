"""The public `kernels` API routes CPU tensors to the torch references."""

from __future__ import annotations

import torch

from flotilla import kernels
from flotilla.kernels.paged_attention import paged_attention_ref
from tests.kernels.attention_cases import make_case


def test_cpu_tensors_use_the_references() -> None:
    x = torch.randn(3, 16)
    w = torch.randn(16)
    assert not kernels.use_triton(x)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6),
                               x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    out, res = kernels.fused_add_rms_norm(x, x, w, 1e-6)
    torch.testing.assert_close(res, 2 * x)
    expected = torch.nn.functional.silu(x) * x
    torch.testing.assert_close(kernels.silu_and_mul(torch.cat([x, x], -1)), expected)


def test_cpu_paged_attention_roundtrip_through_write_kv_cache() -> None:
    case = make_case([3, 1], [3, 9], 4, 2, 16, 8, torch.float32)
    if case.q.is_cuda:
        return
    k = torch.randn(4, 2, 16)
    slots = torch.tensor([44, 45, -1, 47])
    flat_before = case.k_cache.clone()
    kernels.write_kv_cache(k, k, case.k_cache, case.v_cache, slots)
    flat, before = case.k_cache.view(-1, 2, 16), flat_before.view(-1, 2, 16)
    assert torch.equal(flat[[44, 45, 47]], k[[0, 1, 3]])
    assert torch.equal(flat[:44], before[:44]) and torch.equal(flat[46], before[46])
    out = kernels.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(case.q, case.k_cache, case.v_cache,
                                                        case.meta, 0.25))
