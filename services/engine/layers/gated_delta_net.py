"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5.

Per token: one projection gives q, k, v (the conv1d's channels) and the output gate z, another
the per-head b and a; q, k, v run through a short causal depthwise conv1d with SiLU; then the
gated delta rule (kernels/gated_delta.py) with beta = sigmoid(b) and the log-decay
g = -exp(A_log) * softplus(a + dt_bias), q and k l2-normalised and q scaled by Dk^-0.5; the
output is RMS-normalised per value head, gated by silu(z) (`GatedRMSNorm`) and projected out.

Rules:
- The layer never allocates its state: the ModelRunner binds each layer one conv-state view
  [S, C, W-1] (model dtype) and one recurrent-state view [S, Hv, Dk, Dv] (fp32) of the state
  pool (services/engine/state_pool.py) with `bind_state`; `state_shapes()` says what it needs.
  Each sequence's slot is `state_indices` of the forward context; a decode-only step
  (max_query_len 1, the CUDA-graph case) updates the slots in place and skips rows of index -1,
  any other step runs the packed varlen kernels over the real rows (padding rows after them get
  zero output), each sequence starting from its slot's state when `has_initial_state`.
- Weights in this layer's layout: `in_proj_qkvz` packs q, k, v, z (shard ids 0..3: per rank, its
  key heads' q and k, its value heads' v and z); `in_proj_ba` packs b, a (0, 1). Qwen3.5
  checkpoints store `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`, Qwen3-Next
  `in_proj_qkvz` / `in_proj_ba` interleaved per key head: `split_checkpoint_tensor` turns both
  into the per-shard names `in_proj_{q,k,v,z,b,a}` that a model maps onto the packs.
- Tensor parallel: key and value heads are split across ranks (a value head's key head is on the
  same rank), so are the conv channels, A_log and dt_bias; out_proj is row parallel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels import gated_delta
from flotilla.kernels.selection import Selecting
from flotilla.services.engine.distributed import divide, get_tp_rank, get_tp_size
from flotilla.services.engine.forward_context import get_forward_context
from flotilla.services.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.quant.base import QuantConfig

# checkpoint sub-names -> (packed parameter, shard id); a model puts these in its mapping
GDN_PACKED: dict[str, tuple[str, str | int]] = {
    "in_proj_q": ("in_proj_qkvz", 0), "in_proj_k": ("in_proj_qkvz", 1),
    "in_proj_v": ("in_proj_qkvz", 2), "in_proj_z": ("in_proj_qkvz", 3),
    "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1),
}


class GatedDeltaNetDims:
    """Head counts and sizes of a config's linear-attention layers (whole model, not per rank)."""

    def __init__(self, config: ModelConfig) -> None:
        cfg = config.hf_config
        self.num_k_heads = int(cfg["linear_num_key_heads"])
        self.num_v_heads = int(cfg["linear_num_value_heads"])
        self.head_k_dim = int(cfg["linear_key_head_dim"])
        self.head_v_dim = int(cfg["linear_value_head_dim"])
        self.conv_kernel = int(cfg.get("linear_conv_kernel_dim", 4))
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim


def split_checkpoint_tensor(name: str, tensor: torch.Tensor, dims: GatedDeltaNetDims
                            ) -> Iterable[tuple[str, torch.Tensor]]:
    """A linear-attention projection of a checkpoint as the per-shard names GDN_PACKED maps
    (Qwen3.5's in_proj_qkv, Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba); other
    tensors pass through."""
    prefix, _, leaf = name.rpartition(".")
    if prefix.endswith(".in_proj_qkv"):
        base = prefix.removesuffix("_qkv")
        q, k, v = tensor.split([dims.key_dim, dims.key_dim, dims.value_dim], dim=0)
        return ((f"{base}_q.{leaf}", q), (f"{base}_k.{leaf}", k), (f"{base}_v.{leaf}", v))
    group = dims.num_v_heads // dims.num_k_heads
    if prefix.endswith(".in_proj_qkvz"):  # [Hk, (Dk, Dk, group * Dv, group * Dv), ...]
        base = prefix.removesuffix("_qkvz")
        sizes = [dims.head_k_dim, dims.head_k_dim, group * dims.head_v_dim,
                 group * dims.head_v_dim]
        parts = tensor.unflatten(0, (dims.num_k_heads, sum(sizes))).split(sizes, dim=1)
        return tuple((f"{base}_{n}.{leaf}", p.flatten(0, 1)) for n, p in zip("qkvz", parts,
                                                                             strict=True))
    if prefix.endswith(".in_proj_ba"):  # [Hk, (group, group), ...]
        base = prefix.removesuffix("_ba")
        parts = tensor.unflatten(0, (dims.num_k_heads, 2 * group)).split([group, group], dim=1)
        return tuple((f"{base}_{n}.{leaf}", p.flatten(0, 1)) for n, p in zip("ba", parts,
                                                                             strict=True))
    return ((name, tensor),)


class GatedRMSNorm(nn.Module):
    """y = rms_norm(x) * weight * silu(z) per value head (x, z [N, Dv]), computed as
    transformers' Qwen3NextRMSNormGated: the norm in fp32, the gate in fp32."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)


class _ConvWeight(nn.Module):
    """`conv1d.weight` [C, W] (the checkpoint's [C, 1, W] squeezed); channels q | k | v."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width), requires_grad=False)


class GatedDeltaNet(nn.Module, Selecting):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str
                 ) -> None:
        super().__init__()
        d = self.dims = GatedDeltaNetDims(config)
        tp = get_tp_size()
        self.num_k_heads = divide(d.num_k_heads, tp, "linear-attention key head count")
        self.num_v_heads = divide(d.num_v_heads, tp, "linear-attention value head count")
        self.key_size = self.num_k_heads * d.head_k_dim
        self.value_size = self.num_v_heads * d.head_v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.scale = d.head_k_dim ** -0.5
        self.in_proj_qkvz = MergedColumnParallelLinear(
            config.hidden_size, [d.key_dim, d.key_dim, d.value_dim, d.value_dim], False,
            quant_config, f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = MergedColumnParallelLinear(
            config.hidden_size, [d.num_v_heads, d.num_v_heads], False, quant_config,
            f"{prefix}.in_proj_ba")
        self.conv1d = _ConvWeight(self.conv_dim, d.conv_kernel)
        self.conv1d.weight.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = self._load_per_head  # type: ignore[attr-defined]
        self.norm = GatedRMSNorm(d.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(d.value_dim, config.hidden_size, False, quant_config,
                                          f"{prefix}.out_proj")
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)

    # ------------------------------------------------------------------ weights and state

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's channels of each of the q, k, v blocks."""
        d, rank = self.dims, get_tp_rank()
        full = loaded.reshape(loaded.shape[0], -1)
        blocks = full.split([d.key_dim, d.key_dim, d.value_dim], dim=0)
        sizes = (self.key_size, self.key_size, self.value_size)
        param.data.copy_(torch.cat([b.narrow(0, rank * n, n) for b, n in zip(blocks, sizes,
                                                                             strict=True)]))

    def _load_per_head(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.num_v_heads
        param.data.copy_(loaded.reshape(-1).narrow(0, get_tp_rank() * n, n))

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d = self.dims
        return ((self.conv_dim, d.conv_kernel - 1),
                (self.num_v_heads, d.head_k_dim, d.head_v_dim))

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        conv_shape, state_shape = self.state_shapes()
        if (tuple(conv_state.shape[1:]) != conv_shape
                or tuple(recurrent_state.shape[1:]) != state_shape):
            raise ValueError(f"state views {tuple(conv_state.shape)} / "
                             f"{tuple(recurrent_state.shape)} do not end in {conv_shape} / "
                             f"{state_shape}")
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    # ------------------------------------------------------------------ forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.recurrent_state.numel() == 0:
            raise RuntimeError("GatedDeltaNet.forward before bind_state(): the ModelRunner "
                               "binds it")
        meta = get_forward_context()
        if meta.state_indices is None:
            raise RuntimeError("a linear-attention layer needs the step's state_indices")
        d = self.dims
        mixed, z = self.in_proj_qkvz(hidden).split([self.conv_dim, self.value_size], dim=-1)
        b, a = self.in_proj_ba(hidden).split([self.num_v_heads, self.num_v_heads], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight
        if meta.max_query_len == 1:  # decode-only: in-place updates of every row's slot
            x = gated_delta.causal_conv1d_update(
                mixed, weight, None, conv_state=self.conv_state,
                state_indices=meta.state_indices, kernels=self.selection.kernels)
            q, k, v = self._heads(x)
            o = gated_delta.fused_recurrent_gated_delta_rule_update(
                q, k, v, g, beta, scale=self.scale, state=self.recurrent_state,
                state_indices=meta.state_indices, use_qk_l2norm=True,
                kernels=self.selection.kernels)
        else:
            o = self._varlen(mixed, g, beta, meta.query_start_loc_cpu[-1])
        o = self.norm(o.reshape(-1, d.head_v_dim), z.reshape(-1, d.head_v_dim))
        return self.out_proj(o.reshape(hidden.shape[0], self.value_size))

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, t = self.dims, x.shape[0]
        q, k, v = x.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (q.reshape(t, self.num_k_heads, d.head_k_dim),
                k.reshape(t, self.num_k_heads, d.head_k_dim),
                v.reshape(t, self.num_v_heads, d.head_v_dim))

    def _varlen(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, t: int
                ) -> torch.Tensor:
        """Prefill chunks and mixed steps: the real rows :t, packed per sequence."""
        meta = get_forward_context()
        assert meta.state_indices is not None and meta.has_initial_state is not None
        x = gated_delta.causal_conv1d_varlen(
            mixed[:t], self.conv1d.weight, None, conv_state=self.conv_state,
            state_indices=meta.state_indices, cu_seqlens=meta.query_start_loc,
            has_initial_state=meta.has_initial_state, kernels=self.selection.kernels)
        q, k, v = self._heads(x)
        slots = meta.state_indices.long()
        initial = torch.where(meta.has_initial_state[:, None, None, None],
                              self.recurrent_state[slots], 0.0)
        o, final = gated_delta.chunk_gated_delta_rule(
            q, k, v, g[:t], beta[:t], scale=self.scale, initial_state=initial,
            cu_seqlens=meta.query_start_loc, use_qk_l2norm=True, kernels=self.selection.kernels)
        self.recurrent_state[slots] = final.to(self.recurrent_state.dtype)
        if t < mixed.shape[0]:  # padding rows (bucketed eager steps): zero output
            o = F.pad(o, (0, 0, 0, 0, 0, mixed.shape[0] - t))
        return o
