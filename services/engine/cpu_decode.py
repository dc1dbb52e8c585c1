"""CPU decode step of a plain Llama-family model in flat torch ops (what the CUDA graphs are to a
GPU decode step: the same forward with the per-module Python and the per-linear casts taken out).

A decode step on a small CPU is bound by dispatches, not bytes: the module path runs ~85 eager
ops a layer (casts around every weight-only linear, a gathered copy of the whole KV history per
layer, a rotary table lookup per layer). This path runs the same math in ~25 a layer:
- the residual stream stays float32; the normed activations go to bf16 once (the int4 / int8
  kernels' input) and the linears' bf16 outputs feed the next op without a cast back;
- the rotary's cos / sin rows are looked up once a step and applied to q and k together;
- batch-1 attention reads the paged cache in place: the sequence's blocks as runs of
  consecutive ids, one SDPA on a view when they are one run (the usual case: the pool hands out
  blocks in order), else scores per run and one softmax over them; batches of several
  sequences use the batched reference (kernels.paged_attention).
Numerics: the same ops in the same dtypes as the module path (SiLU-and-mul in float32 included: in
bf16 it moved logits by ~2% and flipped near-tied greedy tokens), so the logits are equal
(tests/engine/test_cpu_decode.py).

Where the C++ step of cpu_native.py builds (gcc and ninja present), `logits` is that one call
(the same math, its numerics in tests/engine/test_cpu_native.py); `torch_logits` is this module's
torch ops, the fallback and the reference.

`CpuDecode.build(model)` returns None for anything it does not cover (another layer or norm
class, biases, q/k norms, partial / non-neox / scaled rotary, sliding windows, softcaps, sinks,
fp8 KV, tensor parallel, float or other quantized linears); the module path serves those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.services.engine import cpu_native
from flotilla.services.engine.distributed import get_tp_size
from flotilla.services.engine.layers.activation import SiluAndMul
from flotilla.services.engine.layers.attention import Attention
from flotilla.services.engine.layers.layernorm import RMSNorm
from flotilla.services.engine.layers.rotary import RotaryEmbedding
from flotilla.services.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from flotilla.services.engine.quant.int4 import GROUP_SIZE, Int4WeightOnlyMethod
from flotilla.services.engine.quant.int8 import Int8WeightOnlyMethod

_BF16 = torch.bfloat16
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
MAX_RUNS = 8  # more runs of blocks than this: the batched reference's gather instead

Matmul = Callable[[torch.Tensor], torch.Tensor]


def _quantized(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int4 packed uint8, scales-and-zeros) or (int8, scales) of a weight-only linear without
    bias; None for anything else."""
    method = getattr(linear, "quant_method", None)
    if getattr(linear, "bias", None) is not None:
        return None
    if type(method) is Int4WeightOnlyMethod:
        names = ("weight_int4", "weight_scale_zero")
    elif type(method) is Int8WeightOnlyMethod:
        names = ("weight_int8", "weight_scale")
    else:
        return None
    weight, scales = (getattr(linear, n) for n in names)
    assert isinstance(weight, torch.Tensor) and isinstance(scales, torch.Tensor)
    return weight, scales


def _matmul(weights: tuple[torch.Tensor, torch.Tensor]) -> Matmul:
    """x bf16 [M, K] -> bf16 [M, N] of `_quantized`'s weights."""
    weight, scales = weights
    if weight.dtype == torch.uint8:
        return lambda x: _INT4_MM(x, weight, GROUP_SIZE, scales)
    return lambda x: _INT8_MM(x, weight, scales)


@dataclass
class _CacheViews:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_rows: torch.Tensor  # [slots, Hk, 2, D / 2]: rotated keys land here as computed
    v_rows: torch.Tensor  # [slots, Hk * D]
    k_heads: torch.Tensor  # [1, Hk, slots, D]: SDPA's layout, a view
    v_heads: torch.Tensor


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Matmul
    o_proj: Matmul
    gate_up: Matmul
    down: Matmul
    attn: Attention  # its bound k_cache / v_cache
    weights: list[torch.Tensor]  # the native step's: norms, then each linear's two tensors
    views: _CacheViews | None = None


def _layer(layer: nn.Module, eps: float) -> _Layer | None:
    if type(layer) is not LlamaDecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn, LlamaAttention) or not isinstance(mlp, LlamaMLP):
        return None
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
        return None
    rotary, inner = attn.rotary_emb, attn.attn
    plain_attention = (
        inner.sinks is None
        and inner.attention_chunk is None
        and inner.sliding_window is None
        and inner.logit_softcap is None
    )
    if (
        attn.has_qk_norm
        or not attn.fused_rotary
        or type(rotary) is not RotaryEmbedding
        or not rotary.is_neox
        or rotary.rotary_dim != attn.head_dim
        or not plain_attention
        or not isinstance(mlp.act_fn, SiluAndMul)
    ):
        return None
    norms = [layer.norms[slot] for slot in ("pre_attn", "post_attn", "pre_mlp", "post_mlp")]
    if norms[1] is not None or norms[3] is not None:
        return None
    pre_attn, pre_mlp = norms[0], norms[2]
    for n in (pre_attn, pre_mlp):
        if not isinstance(n, RMSNorm) or type(n) is not RMSNorm or n.eps != eps:
            return None
        if n.weight.dtype != torch.float32:
            return None
    assert isinstance(pre_attn, RMSNorm) and isinstance(pre_mlp, RMSNorm)
    quants = [_quantized(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                      mlp.down_proj)]
    weights: list[torch.Tensor] = [pre_attn.weight, pre_mlp.weight]
    for q in quants:
        if q is None:
            return None
        weights.extend(q)
    qkv, o_proj, gate_up, down = (_matmul(q) for q in quants if q is not None)
    return _Layer(pre_attn.weight, pre_mlp.weight, qkv, o_proj, gate_up, down, inner, weights)


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive block ids: [(first block, number of blocks)], in order."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def attend_in_place(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: list[tuple[int, int]],
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's decode attention, q [Hq, D] over its first `seq_len` cached tokens, which
    sit in `runs` of consecutive blocks of k_cache / v_cache [num_blocks, bs, Hk, D]; nothing is
    copied out of the cache. Returns [Hq, D] (float32 math, q's dtype)."""
    bs, hk, d = k_cache.shape[1:]
    hq = q.shape[0]
    keys = k_cache.view(-1, hk, d)
    values = v_cache.view(-1, hk, d)
    if len(runs) == 1:
        start = runs[0][0] * bs
        k = keys[start : start + seq_len].transpose(0, 1)  # [Hk, L, D] view
        v = values[start : start + seq_len].transpose(0, 1)
        one = F.scaled_dot_product_attention(
            q.view(1, hq, 1, d), k[None], v[None], scale=scale, enable_gqa=hq != hk
        )
        return one.view(hq, d)
    # Several runs: scores run by run, one softmax over all of them, values run by run.
    qg = q.view(hk, hq // hk, d)
    spans, left = [], seq_len
    for first, count in runs:
        n = min(count * bs, left)
        spans.append((first * bs, n))
        left -= n
        if not left:
            break
    scores = torch.cat([torch.matmul(qg, keys[s : s + n].permute(1, 2, 0)) for s, n in spans], -1)
    probs = torch.softmax(scores * scale, -1)
    out: torch.Tensor | None = None
    offset = 0
    for s, n in spans:
        part = torch.matmul(probs[..., offset : offset + n], values[s : s + n].transpose(0, 1))
        out = part if out is None else out.add_(part)
        offset += n
    assert out is not None
    return out.view(hq, d)


class CpuDecode:
    """Logits of a decode-only step (every row one sequence's new token), float32 [B, vocab]."""

    def __init__(self, model: LlamaForCausalLM, layers: list[_Layer],
                 head: tuple[torch.Tensor, torch.Tensor], native: bool = True) -> None:
        first: LlamaAttention = model.model.layers[0].self_attn  # type: ignore[assignment]
        self.embed: torch.Tensor = model.model.embed_tokens.weight
        self.layers, self.head = layers, _matmul(head)
        norm: RMSNorm = model.model.norm  # type: ignore[assignment]
        self.final_norm: torch.Tensor = norm.weight
        self.eps: float = norm.eps
        self.hq, self.hk, self.d = int(first.num_heads), int(first.num_kv_heads), first.head_dim
        self.scale: float = first.attn.scale
        self.cos_sin: torch.Tensor = first.rotary_emb.cos_sin_cache
        self.hidden: int = self.embed.shape[1]
        # the whole step as one C++ call (cpu_native.py) where it builds; None: the torch ops
        self.native = cpu_native.decode_step() if native else None
        self._weights = [w for layer in layers for w in layer.weights]
        self._head_weights = [self.final_norm, *head]
        self._cos_sin_f32 = self.cos_sin.float().contiguous()

    @classmethod
    def build(cls, model: nn.Module, native: bool = True) -> CpuDecode | None:
        """The decode path for `model`, or None where it does not apply (module docstring);
        native=False: the torch ops even where the C++ step builds."""
        if (
            type(model) is not LlamaForCausalLM
            or type(model.model) is not LlamaModel
            or get_tp_size() != 1
            or type(model.model.norm) is not RMSNorm
            or model.model.embed_tokens.weight.dtype != torch.float32
        ):
            return None
        eps = model.model.norm.eps
        layers = [_layer(layer, eps) for layer in model.model.layers]
        head = _quantized(model.lm_head)
        if head is None or not layers or any(layer is None for layer in layers):
            return None
        attns: list[LlamaAttention] = [layer.self_attn for layer in model.model.layers]  # type: ignore[misc]
        tables = {id(a.rotary_emb.cos_sin_cache) for a in attns}
        scales = {a.attn.scale for a in attns}
        if len(tables) != 1 or len(scales) != 1:
            return None
        return cls(model, [layer for layer in layers if layer is not None], head, native)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, 2, D / 2] with rotate(x) = x * cos + halves_swapped(x) *
        sin: the reference's o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin, the same roundings."""
        cos, sin = self.cos_sin.index_select(0, positions).float().chunk(2, -1)
        return torch.stack((cos, cos), 1)[:, None], torch.stack((-sin, sin), 1)[:, None]

    def _views(self, layer: _Layer) -> _CacheViews:
        """The layer's cache as rows [slots, Hk, 2, D / 2] and [slots, Hk * D] and heads-first
        [1, Hk, slots, D] (built once per bound cache)."""
        k_cache, v_cache = layer.attn.k_cache, layer.attn.v_cache
        views = layer.views
        if views is None or views.k_cache is not k_cache or views.v_cache is not v_cache:
            if k_cache.dtype != torch.float32:  # the model dtype (float32, checked at build)
                raise ValueError(f"CPU decode over a {k_cache.dtype} KV cache")
            hk, d = self.hk, self.d
            k_rows, v_rows = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)
            views = layer.views = _CacheViews(
                k_cache,
                v_cache,
                k_rows.view(-1, hk, 2, d // 2),
                v_rows.view(-1, hk * d),
                k_rows.transpose(0, 1)[None],
                v_rows.transpose(0, 1)[None],
            )
        return views

    def logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.native is not None:
            caches = [c for layer in self.layers for c in (layer.attn.k_cache, layer.attn.v_cache)]
            return self.native(
                input_ids.long(), positions.long(), meta.slot_mapping.long(),
                meta.block_tables.int(), meta.seq_lens.int(), self.embed, self._cos_sin_f32,
                self._weights, caches, self._head_weights, self.eps, self.scale, self.hq,
                self.hk, GROUP_SIZE,
            )
        return self.torch_logits(input_ids, positions, meta)

    def torch_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The step in torch ops (where the C++ step is not built; its reference in tests)."""
        t, hq, hk, d = input_ids.shape[0], self.hq, self.hk, self.d
        cos, sin = self._rotary(positions)
        single = -1  # batch 1 over one run of blocks: that run's first slot
        runs: list[tuple[int, int]] = []
        seq_len = slot = 0
        if t == 1:
            bs = self.layers[0].attn.k_cache.shape[1]
            seq_len = meta.seq_lens_cpu[0]
            runs = block_runs(meta.block_tables[0, : -(-seq_len // bs)].tolist())
            slot = (runs[-1][0] + runs[-1][1] - 1) * bs + (seq_len - 1) % bs
            if len(runs) == 1:
                single = runs[0][0] * bs
        batched = t > 1 or len(runs) > MAX_RUNS
        slots = meta.slot_mapping
        qkd = (hq + hk) * d
        residual = F.embedding(input_ids, self.embed)
        for layer in self.layers:
            views = self._views(layer)
            x = F.rms_norm(residual, (self.hidden,), layer.attn_norm, self.eps).to(_BF16)
            qkv = layer.qkv(x)
            qk = qkv[:, :qkd].view(t, hq + hk, 2, d // 2)  # bf16 * fp32: the fp32 products
            qk = (qk * cos).add_(qk.flip(2) * sin)
            if t == 1:  # one row: copies into the slot, no index tensors
                views.k_rows.narrow(0, slot, 1).copy_(qk[:, hq:])
                views.v_rows.narrow(0, slot, 1).copy_(qkv[:, qkd:])
            else:
                views.k_rows.index_copy_(0, slots, qk[:, hq:])
                views.v_rows.index_copy_(0, slots, qkv[:, qkd:].float())
            if single >= 0:
                out = F.scaled_dot_product_attention(
                    qk[:, :hq].view(1, hq, 1, d),
                    views.k_heads.narrow(2, single, seq_len),
                    views.v_heads.narrow(2, single, seq_len),
                    scale=self.scale,
                    enable_gqa=hq != hk,
                )
            elif not batched:
                out = attend_in_place(
                    qk[0, :hq].reshape(hq, d),
                    layer.attn.k_cache,
                    layer.attn.v_cache,
                    runs,
                    seq_len,
                    self.scale,
                )
            else:
                q = qk[:, :hq].view(t, hq, d)
                out = kernels.paged_attention(
                    q, layer.attn.k_cache, layer.attn.v_cache, meta, self.scale
                )
            residual.add_(layer.o_proj(out.reshape(t, hq * d).to(_BF16)))
            x = F.rms_norm(residual, (self.hidden,), layer.mlp_norm, self.eps).to(_BF16)
            gate, up = layer.gate_up(x).chunk(2, -1)
            residual.add_(layer.down(F.silu(gate.float()).mul_(up).to(_BF16)))
        x = F.rms_norm(residual, (self.hidden,), self.final_norm, self.eps).to(_BF16)
        return self.head(x).float()
