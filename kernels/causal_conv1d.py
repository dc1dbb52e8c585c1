"""Depthwise causal conv1d + SiLU over packed sequences, with a per-sequence conv state pool.

y[t, c] = silu(bias[c] + sum_w weight[c, w] * x_ext[t - (W-1) + w, c]) where x_ext is the
sequence's inputs preceded by its W-1 previous inputs: conv_state[idx] when the sequence
continues (has_initial_state) and zeros for a new one, which is transformers' Qwen3-Next
causal_conv1d_fn (F.conv1d with padding W-1, cut to L) and causal_conv1d_update.

conv_state [S, C, W-1] keeps each sequence's last W-1 inputs, oldest first, in channels-major
order as transformers' cache does (its layer keeps W columns: ours = theirs[..., 1:], and theirs =
F.pad(ours, (1, 0)) since the oldest of its W columns never reaches an output). Math in fp32,
with transformers' two roundings to x's dtype: the conv output (its F.conv1d runs in the model
dtype) and silu's; the state in its own dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.triton_compat import tl, triton


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
        pre = F.conv1d(ext[None], w, b, groups=channels)[0].to(x.dtype)
        y[lo:hi] = F.silu(pre.float()).T.to(x.dtype)
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
    y[rows] = F.silu(out.to(x.dtype).float()).to(x.dtype)
    conv_state[idx] = ext[..., 1:].to(conv_state.dtype)
    return y


@triton.jit
def _conv_varlen_kernel(
    x_ptr,  # [T, C] inputs (channels contiguous)
    w_ptr,  # [C, W] weight, contiguous
    b_ptr,  # [C] bias (read when HAS_BIAS)
    state_ptr,  # [S, C, W-1] conv state pool: read, then written in place
    slot_ptr,  # int32 [N] pool row of each sequence (< 0: none)
    init_ptr,  # int8 [N] 1: the sequence continues from its state
    chunk_seq_ptr,  # int32 [B] sequence of each block of BT tokens
    chunk_start_ptr,  # int32 [B] first token of each block
    cu_ptr,  # int32 [N+1]
    y_ptr,  # out [T, C], contiguous
    stride_xt,
    stride_ss,
    stride_sc,
    stride_sw,
    C,
    W: tl.constexpr,  # kernel width
    BW: tl.constexpr,  # next power of two >= W-1
    HAS_BIAS: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    seq = tl.load(chunk_seq_ptr + tl.program_id(0))
    start = tl.load(chunk_start_ptr + tl.program_id(0))
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    use_state = (slot >= 0) & (tl.load(init_ptr + seq) != 0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    rows = start + tl.arange(0, BT)
    mask_rows = rows < eos
    state_base = state_ptr + slot * stride_ss + offs_c[None, :] * stride_sc
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for tap in tl.static_range(W):
        pos = rows - bos - (W - 1) + tap  # position in the sequence; < 0: from the state
        mask = mask_rows[:, None] & mask_c[None, :]
        xv = tl.load(
            x_ptr + (bos + pos).to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
            mask=mask & (pos >= 0)[:, None],
            other=0.0,
        ).to(tl.float32)
        sv = tl.load(
            state_base + (W - 1 + pos)[:, None] * stride_sw,
            mask=mask & (pos < 0)[:, None] & use_state,
            other=0.0,
        ).to(tl.float32)
        wt = tl.load(w_ptr + offs_c * W + tap, mask=mask_c, other=0.0).to(tl.float32)
        acc += (xv + sv) * wt[None, :]
    acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the conv output's rounding
    y = acc * tl.sigmoid(acc)
    tl.store(
        y_ptr + rows.to(tl.int64)[:, None] * C + offs_c[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask_rows[:, None] & mask_c[None, :],
    )
    if (start == bos) & (slot >= 0):
        # The sequence's first block is the only one reading its state: it writes the new one.
        col = tl.arange(0, BW)
        tail_pos = eos - bos - (W - 1) + col
        tail_mask = mask_c[:, None] & (col < W - 1)[None, :]
        tail_x = tl.load(
            x_ptr + (bos + tail_pos).to(tl.int64)[None, :] * stride_xt + offs_c[:, None],
            mask=tail_mask & (tail_pos >= 0)[None, :],
            other=0.0,
        ).to(tl.float32)
        new_base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
        tail_s = tl.load(
            new_base + (W - 1 + tail_pos)[None, :] * stride_sw,
            mask=tail_mask & (tail_pos < 0)[None, :] & use_state,
            other=0.0,
        ).to(tl.float32)
        tl.debug_barrier()  # every thread's reads of the old state come first
        tl.store(
            new_base + col[None, :] * stride_sw,
            (tail_x + tail_s).to(state_ptr.dtype.element_ty),
            mask=tail_mask,
        )


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [N, C] one input per sequence (channels contiguous)
    w_ptr,  # [C, W] weight, contiguous
    b_ptr,  # [C] bias (read when HAS_BIAS)
    state_ptr,  # [S, C, W-1] conv state pool, shifted in place
    slot_ptr,  # int32 [N] (< 0: padding)
    y_ptr,  # out [N, C], contiguous
    stride_xn,
    stride_ss,
    stride_sc,
    stride_sw,
    C,
    W: tl.constexpr,
    BW: tl.constexpr,  # next power of two >= W
    HAS_BIAS: tl.constexpr,
    BC: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        tl.store(y_ptr + n * C + offs_c, tl.zeros([BC], dtype=y_ptr.dtype.element_ty), mask=mask_c)
        return
    col = tl.arange(0, BW)
    base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    old = tl.load(
        base + col[None, :] * stride_sw, mask=mask_c[:, None] & (col < W - 1)[None, :], other=0.0
    ).to(tl.float32)
    x = tl.load(x_ptr + n * stride_xn + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    window = tl.where((col == W - 1)[None, :], x[:, None], old)  # [BC, BW]: oldest first
    wt = tl.load(
        w_ptr + offs_c[:, None] * W + col[None, :],
        mask=mask_c[:, None] & (col < W)[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.sum(window * wt, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the conv output's rounding
    tl.store(
        y_ptr + n * C + offs_c, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=mask_c
    )
    tl.debug_barrier()  # every thread's reads of the old state come first
    tl.store(
        base + (col - 1)[None, :] * stride_sw,
        window.to(state_ptr.dtype.element_ty),
        mask=mask_c[:, None] & ((col >= 1) & (col < W))[None, :],
    )


def _channels_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    block_t: int = 32,
    block_c: int = 128,
) -> torch.Tensor:
    """Grid (token blocks of each sequence, channel blocks); shapes checked by gated_delta.py."""
    from flotilla.kernels.gated_delta_chunk import sequence_chunks

    channels, width = weight.shape
    if width - 1 > block_t:  # a sequence's first block must hold every read of its old state
        raise ValueError(f"conv width {width} needs block_t >= {width - 1}")
    x = _channels_contiguous(x)
    weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    chunks = sequence_chunks(cu_seqlens, block_t)
    if chunks.start.numel() == 0:
        return y
    _conv_varlen_kernel[(chunks.start.numel(), triton.cdiv(channels, block_c))](
        x,
        weight,
        weight if bias is None else bias,
        conv_state,
        state_indices,
        has_initial_state.to(torch.int8),
        chunks.sequence,
        chunks.start,
        cu_seqlens,
        y,
        x.stride(0),
        *conv_state.stride(),
        channels,
        W=width,
        BW=triton.next_power_of_2(max(width - 1, 1)),
        HAS_BIAS=bias is not None,
        BT=block_t,
        BC=block_c,
        num_warps=4,
    )
    return y


def causal_conv1d_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    block_c: int = 256,
) -> torch.Tensor:
    """Grid (sequences, channel blocks); shapes checked by gated_delta.py."""
    channels, width = weight.shape
    x = _channels_contiguous(x)
    weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] > 0:
        _conv_update_kernel[(x.shape[0], triton.cdiv(channels, block_c))](
            x,
            weight,
            weight if bias is None else bias,
            conv_state,
            state_indices,
            y,
            x.stride(0),
            *conv_state.stride(),
            channels,
            W=width,
            BW=triton.next_power_of_2(width),
            HAS_BIAS=bias is not None,
            BC=block_c,
            num_warps=4,
        )
    return y
