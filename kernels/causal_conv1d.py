"""Depthwise causal conv1d + SiLU over packed sequences, with a per-sequence conv state pool.

y[t, c] = silu(bias[c] + sum_w weight[c, w] * x_ext[t - (W-1) + w, c]) where x_ext is the
sequence's inputs preceded by its W-1 previous inputs: conv_state[idx] when the sequence
continues (has_initial_state) and zeros for a new one, which is transformers' Qwen3-Next
causal_conv1d_fn (F.conv1d with padding W-1, cut to L) and causal_conv1d_update.

conv_state [S, C, W-1] keeps each sequence's last W-1 inputs, oldest first, in channels-major
order as transformers' cache does (its layer keeps W columns: ours = theirs[..., 1:], and theirs =
F.pad(ours, (1, 0)) since the oldest of its W columns never reaches an output). Math in fp32;
y in x's dtype; the state in its own dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_varlen_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Prefill x [T, C] (sequences packed by cu_seqlens); writes each sequence's last W-1 inputs
    to conv_state[state_indices[i]] (index < 0: neither read nor written)."""
    channels, width = weight.shape
    w = weight.float()[:, None, :]
    b = None if bias is None else bias.float()
    y = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    indices = state_indices.tolist()
    initial = has_initial_state.tolist()
    for i, idx in enumerate(indices):
        lo, hi = bounds[i], bounds[i + 1]
        if idx >= 0 and initial[i]:
            prev = conv_state[idx].float()
        else:
            prev = torch.zeros(channels, width - 1, dtype=torch.float32, device=x.device)
        ext = torch.cat([prev, x[lo:hi].T.float()], dim=1)
        y[lo:hi] = F.silu(F.conv1d(ext[None], w, b, groups=channels)[0]).T.to(x.dtype)
        if idx >= 0:
            conv_state[idx] = ext[:, ext.shape[1] - (width - 1) :].to(conv_state.dtype)
    return y


def causal_conv1d_update_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Decode x [N, C], one token per sequence: shifts conv_state[state_indices[n]] left by one
    and appends x[n]; rows with index < 0 are padding (state untouched, y zeros)."""
    rows = (state_indices >= 0).nonzero().squeeze(1)
    idx = state_indices[rows].long()
    ext = torch.cat([conv_state[idx].float(), x[rows].float()[..., None]], dim=-1)
    out = (ext * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    y = torch.zeros_like(x)
    y[rows] = F.silu(out).to(x.dtype)
    conv_state[idx] = ext[..., 1:].to(conv_state.dtype)
    return y
