"""Torch implementations of the Gated DeltaNet ops (Qwen3-Next / Qwen3.5 linear attention).

The recurrence, per value head h with key head h // (Hv // Hk), state S [Dk, Dv] (fp32):
    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T        (the delta rule)
    o_t = S_t^T (scale * q_t)
with q, k l2-normalised first when use_qk_l2norm (x * rsqrt(sum(x^2) + 1e-6), in fp32): exactly
transformers' torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule.

The prefill form processes each sequence in chunks of 64 tokens (starting at the sequence's first
token, as transformers does). Within a chunk, with cumulative log-decays G_i = g_1 + ... + g_i,
A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i and T = (I + A)^-1 (the UT transform):
    u = T (beta v),  w = T (beta exp(G) k),  v_new = u - w S0
    o = exp(G) (q S0) + ((q k^T) o exp(G_i - G_j))_{j <= i} v_new
    S = exp(G_last) S0 + (exp(G_last - G) k)^T v_new
These are the CPU paths behind kernels/gated_delta.py and the references of the Triton kernels.
"""

from __future__ import annotations

import torch

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _queries_keys(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (scale * q, k), normalised if asked, repeated to one row per value head."""
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    group = num_v_heads // q.shape[1]
    return (qf * scale).repeat_interleave(group, dim=1), kf.repeat_interleave(group, dim=1)


def _chunk_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence, heads first: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L],
    state [H, Dk, Dv] -> (o [H, L, Dv], new state)."""
    length = q.shape[1]
    cum = g.cumsum(-1)
    ones = torch.ones(length, length, dtype=torch.bool, device=q.device)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~ones.tril(), float("-inf")).exp()
    a = (beta[:, :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~ones.tril(-1), 0.0)
    rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)
    uw = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = uw[..., : v.shape[-1]], uw[..., v.shape[-1] :]
    v_new = u - w @ state
    o = (cum.exp()[..., None] * q) @ state + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    last = cum[:, -1:]
    k_decayed = (last - cum).exp()[..., None] * k
    state = last.exp()[..., None] * state + k_decayed.transpose(-1, -2) @ v_new
    return o, state


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed q, k [T, Hk, Dk], v [T, Hv, Dv] -> (o [T, Hv, Dv], final [N, Hv, Dk, Dv])."""
    num_v_heads, dv = v.shape[1:]
    dk = k.shape[-1]
    qf, kf = _queries_keys(q, k, num_v_heads, scale, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    bounds = cu_seqlens.tolist()
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    final = torch.zeros(len(bounds) - 1, num_v_heads, dk, dv, dtype=torch.float32, device=v.device)
    for i in range(len(bounds) - 1):
        state = final[i] if initial_state is None else initial_state[i].float().clone()
        for lo in range(bounds[i], bounds[i + 1], CHUNK):
            hi = min(lo + CHUNK, bounds[i + 1])
            out, state = _chunk_step(
                qf[lo:hi].transpose(0, 1),
                kf[lo:hi].transpose(0, 1),
                vf[lo:hi].transpose(0, 1),
                gf[lo:hi].T,
                bf[lo:hi].T,
                state,
            )
            o[lo:hi] = out.transpose(0, 1)
        final[i] = state
    return o.to(v.dtype), final


def fused_recurrent_gated_delta_rule_update_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """One token per sequence; state [S, Hv, Dk, Dv] updated in place at rows state_indices
    (rows < 0 are padding: no state touched, output zeros)."""
    qf, kf = _queries_keys(q, k, v.shape[1], scale, use_qk_l2norm)
    rows = (state_indices >= 0).nonzero().squeeze(1)
    idx = state_indices[rows].long()
    s = state[idx].float() * g[rows].float().exp()[..., None, None]
    kr, qr = kf[rows], qf[rows]
    kv = (s * kr[..., None]).sum(-2)
    delta = (v[rows].float() - kv) * beta[rows].float()[..., None]
    s = s + kr[..., None] * delta[..., None, :]
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    o[rows] = (s * qr[..., None]).sum(-2)
    state[idx] = s.to(state.dtype)
    return o.to(v.dtype)
