"""Fused-MoE kernel against its torch reference, and the reference against a per-token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels.activation import SwigluOAI
from flotilla.kernels.fused_moe import fused_moe_ref, fused_moe_triton, moe_align_block_size
from tests.kernels.conftest import DEVICE, tolerance


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
          seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return tuple(t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids))


def _per_token_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = w13[e] @ x[t]
            out[t] += weights[t, k] * (w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def test_reference_matches_per_token_loop() -> None:
    x, w13, w2, weights, ids = (t.cpu() for t in _case(7, 24, 20, 5, 2, torch.float32))
    ids[3, 1] = -1  # an expert of another rank: contributes nothing
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids),
                               _per_token_loop(x, w13, w2, weights, ids))


def test_align_block_size_tiles_hold_one_expert() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [-1, 2], [2, 1]])
    sorted_ids, expert_ids = moe_align_block_size(ids, 4, block_m=4)
    assert sorted_ids.numel() % 4 == 0 and expert_ids.numel() == sorted_ids.numel() // 4
    flat = ids.reshape(-1)
    seen = []
    for tile, expert in enumerate(expert_ids.tolist()):
        rows = [p for p in sorted_ids[tile * 4:(tile + 1) * 4].tolist() if p < flat.numel()]
        if expert < 0:
            assert rows == []
        assert all(int(flat[p]) == expert for p in rows)
        seen += rows
    assert sorted(seen) == [p for p in range(flat.numel()) if flat[p] >= 0]
    # experts 0, 1, 2, 3 hold 2, 1, 5, 1 pairs: expert 2 needs two tiles; the rest are unused.
    assert expert_ids.tolist()[:5] == [0, 1, 2, 2, 3] and set(expert_ids.tolist()[5:]) <= {-1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (1, 32, 16, 4, 2),  # decode: one token
    (9, 48, 40, 6, 2),  # ragged sizes: masks on every dimension
    (21, 32, 24, 8, 3),  # several tiles per expert with block_m=16
])
def test_fused_moe_matches_reference(dtype: torch.dtype, tokens: int, hidden: int, inter: int,
                                     experts: int, top_k: int) -> None:
    x, w13, w2, weights, ids = _case(tokens, hidden, inter, experts, top_k, dtype)
    out = fused_moe_triton(x, w13, w2, weights, ids, block_m=16, block_n=16, block_k=16)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, **tolerance(dtype, 2.0))


# The dropped pairs' gate_up rows are never written (torch.empty) and never read; silu over that
# garbage may overflow in the interpreter's numpy.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_fused_moe_skips_other_ranks_experts() -> None:
    x, w13, w2, weights, ids = _case(6, 32, 16, 4, 2, torch.float32, seed=3)
    local = torch.where(ids >= 2, ids - 2, -1)  # rank 1 of 2 owns experts 2 and 3
    out = fused_moe_triton(x, w13[2:], w2[2:], weights, local, block_m=16, block_n=16,
                           block_k=16)
    torch.testing.assert_close(out, fused_moe_ref(x, w13[2:], w2[2:], weights, local),
                               **tolerance(torch.float32))


def _gpt_oss_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor,
                     b2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     act: SwigluOAI) -> torch.Tensor:
    """transformers' GptOssExperts.forward on our stacks: interleaved gate/up columns of
    x @ W + b, clamped SwiGLU, down with bias, times the routing weight."""
    inter = w13.shape[1] // 2
    gate_up_w = torch.stack([w13[:, :inter], w13[:, inter:]], 2).flatten(1, 2)  # interleave
    gate_up_b = torch.stack([b13[:, :inter], b13[:, inter:]], 2).flatten(1, 2)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = x[t] @ gate_up_w[e].T + gate_up_b[e]
            gate, up = gate_up[::2].clamp(max=act.limit), gate_up[1::2].clamp(-act.limit,
                                                                              act.limit)
            hidden = (up + 1) * gate * torch.sigmoid(gate * act.alpha)
            out[t] += weights[t, k] * (hidden @ w2[e].T + b2[e])
    return out


def _biases(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return tuple(torch.randn(w.shape[:2], generator=g).to(w) for w in (w13, w2))  # type: ignore


def test_reference_with_biases_and_swiglu_matches_gpt_oss_experts() -> None:
    x, w13, w2, weights, ids = (t.cpu() for t in _case(5, 24, 12, 4, 2, torch.float32))
    b13, b2 = _biases(w13, w2)
    act = SwigluOAI(alpha=1.702, limit=0.5)  # low enough that the clamp cuts
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids, b13, b2, act),
                               _gpt_oss_experts(x, w13, w2, b13, b2, weights, ids, act))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 13])
def test_fused_moe_with_biases_and_swiglu_matches_reference(dtype: torch.dtype,
                                                            tokens: int) -> None:
    x, w13, w2, weights, ids = _case(tokens, 48, 40, 6, 2, dtype, seed=4)
    b13, b2 = _biases(w13, w2)
    act = SwigluOAI(limit=1.0)
    out = fused_moe_triton(x, w13, w2, weights, ids, b13, b2, act, block_m=16, block_n=16,
                           block_k=16)
    ref = fused_moe_ref(x, w13, w2, weights, ids, b13, b2, act)
    torch.testing.assert_close(out, ref, **tolerance(dtype, 2.0))


def test_fused_moe_rejects_bad_shapes() -> None:
    x, w13, w2, weights, ids = _case(2, 32, 16, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_triton(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_triton(x, w13, w2, weights[:, :1], ids)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fused_moe_gpu_realistic(tokens: int) -> None:
    # Mixtral-like expert shapes (hidden 4096, intermediate 14336 scaled down to fit quickly).
    x, w13, w2, weights, ids = _case(tokens, 4096, 2048, 8, 2, torch.bfloat16)
    out = fused_moe_triton(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids),
                               **tolerance(torch.bfloat16, 2.0))


@pytest.mark.gpu
def test_fused_moe_gpu_benchmark() -> None:
    """Opt-in timing of a deepseek-like layer (64 experts, top-6) at a prefill-sized batch."""
    x, w13, w2, weights, ids = _case(4096, 2048, 1408, 64, 6, torch.bfloat16)
    fused_moe_triton(x, w13, w2, weights, ids)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fused_moe_triton(x, w13, w2, weights, ids)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 10
    flops = 2 * 4096 * 6 * 3 * 2048 * 1408
    print(f"fused_moe 4096 tok x top6/64 experts: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
    torch.testing.assert_close(fused_moe_triton(x[:64], w13, w2, weights[:64], ids[:64]),
                               fused_moe_ref(x[:64], w13, w2, weights[:64], ids[:64]),
                               **tolerance(torch.bfloat16, 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_experts_match_transformers_formula(dtype: torch.dtype) -> None:
    """activation="gelu_tanh" (Gemma 4's experts): the kernel against the reference, and the
    reference against transformers' Gemma4TextExperts on the same weights."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    x, w13, w2, weights, ids = _case(9, 32, 24, 4, 2, dtype)
    ref = fused_moe_ref(x, w13, w2, weights, ids, activation="gelu_tanh")
    got = fused_moe_triton(x, w13, w2, weights, ids, activation="gelu_tanh")
    torch.testing.assert_close(got, ref, **tolerance(dtype))
    config = Gemma4TextConfig(hidden_size=32, num_experts=4, moe_intermediate_size=24,
                              hidden_activation="gelu_pytorch_tanh")
    experts = Gemma4TextExperts(config).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13.cpu())
        experts.down_proj.copy_(w2.cpu())
        want = experts(x.cpu(), ids.cpu(), weights.cpu().to(dtype))
    torch.testing.assert_close(ref.cpu(), want, **tolerance(dtype))
    silu = fused_moe_ref(x, w13, w2, weights, ids)
    assert not torch.allclose(silu, ref, **tolerance(dtype))  # the activation really differs
