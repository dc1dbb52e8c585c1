"""Inputs and an independent fp64 token-by-token reference for the Gated DeltaNet tests."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class DeltaInputs(NamedTuple):
    q: torch.Tensor  # [T, Hk, Dk]
    k: torch.Tensor
    v: torch.Tensor  # [T, Hv, Dv]
    g: torch.Tensor  # [T, Hv] fp32, <= 0
    beta: torch.Tensor  # [T, Hv]
    initial_state: torch.Tensor  # [N, Hv, Dk, Dv] fp32
    cu_seqlens: torch.Tensor  # int32 [N+1]


def delta_inputs(
    lengths: list[int],
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> DeltaInputs:
    """Random inputs shaped like a Qwen3-Next layer's: g = -A * softplus(a + dt_bias) spans weak
    to strong decay, beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    a_coef = torch.exp(torch.rand(hv, generator=gen) * 2.0 - 1.0)
    g = -a_coef * F.softplus(randn(total, hv) - 2.0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return DeltaInputs(
        q=randn(total, hk, dk).to(dtype).to(device),
        k=randn(total, hk, dk).to(dtype).to(device),
        v=randn(total, hv, dv).to(dtype).to(device),
        g=g.to(device),
        beta=torch.sigmoid(randn(total, hv)).to(dtype).to(device),
        initial_state=(randn(len(lengths), hv, dk, dv) * 0.3).to(device),
        cu_seqlens=cu.to(device),
    )


def naive_gated_delta(
    inp: DeltaInputs, scale: float, use_qk_l2norm: bool, initial: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64, one token at a time: (o [T, Hv, Dv], final state [N, Hv, Dk, Dv])."""
    q, k, v = inp.q.double().cpu(), inp.k.double().cpu(), inp.v.double().cpu()
    g, beta = inp.g.double().cpu(), inp.beta.double().cpu()
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    hv = v.shape[1]
    head_of = torch.arange(hv) // (hv // q.shape[1])
    q, k = q[:, head_of] * scale, k[:, head_of]
    bounds = inp.cu_seqlens.tolist()
    o = torch.zeros_like(v)
    finals = []
    for i in range(len(bounds) - 1):
        state = (
            inp.initial_state[i].double().cpu().clone()
            if initial
            else torch.zeros(hv, q.shape[-1], v.shape[-1], dtype=torch.float64)
        )
        for t in range(bounds[i], bounds[i + 1]):
            state = state * g[t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", state, k[t])
            state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
            o[t] = torch.einsum("hkv,hk->hv", state, q[t])
        finals.append(state)
    return o, torch.stack(finals)
