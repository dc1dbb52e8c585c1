"""Rotary kernel against its reference; the reference against transformers' apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton
from tests.kernels.conftest import DEVICE, tolerance


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (32, 16), (128, 128)])
def test_rotary_matches_reference(
    dtype: torch.dtype, is_neox: bool, head_dim: int, rot_dim: int
) -> None:
    tokens, hq, hk = 7, 4, 2
    qkv = torch.randn(tokens, hq + 2 * hk, head_dim, dtype=dtype, device=DEVICE)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hk]  # strided views of a fused qkv output
    pos = torch.randint(0, 100, (tokens,), device=DEVICE)
    cache = cos_sin_cache(100, rot_dim).to(DEVICE)
    q_before = q.clone()
    out_q, out_k = rotary_embedding_triton(pos, q, k, cache, is_neox)
    ref_q, ref_k = rotary_embedding_ref(pos, q, k, cache, is_neox)
    torch.testing.assert_close(out_q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(out_k, ref_k, **tolerance(dtype))
    assert torch.equal(q, q_before)


# One token: the reference's joint q/k pass (batch-1 decode); five: separate passes.
@pytest.mark.parametrize("positions", [[0, 3, 4, 9, 17], [11]])
def test_rotary_ref_matches_transformers(positions: list[int]) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokens, hq, hk, dim = len(positions), 4, 2, 32
    q, k = torch.randn(tokens, hq, dim), torch.randn(tokens, hk, dim)
    pos = torch.tensor(positions)
    cache = cos_sin_cache(32, dim)
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    # HF layout is [batch, heads, seq, dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ref_q, ref_k = rotary_embedding_ref(pos, q, k, cache, True)
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(ref_k, hf_k[0].transpose(0, 1))


def test_rotary_ref_gptj_rotates_adjacent_pairs() -> None:
    x = torch.tensor([[[1.0, 0.0, 0.0, 1.0]]])
    cache = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # pair 0 turns by 90 degrees, pair 1 stays
    out, _ = rotary_embedding_ref(torch.tensor([0]), x, x, cache, is_neox=False)
    torch.testing.assert_close(out, torch.tensor([[[0.0, 1.0, 0.0, 1.0]]]))


@pytest.mark.gpu
def test_rotary_gpu_realistic() -> None:
    tokens = 8192
    q = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    cache = cos_sin_cache(8192, 128).cuda()
    out = rotary_embedding_triton(pos, q, k, cache)
    ref = rotary_embedding_ref(pos, q, k, cache)
    torch.testing.assert_close(out.q, ref.q, **tolerance(torch.bfloat16))
    torch.testing.assert_close(out.k, ref.k, **tolerance(torch.bfloat16))
