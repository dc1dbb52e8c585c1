"""Paged attention layer: writes the new tokens' K/V into its cache, then attends over the cache.

Rules:
- The layer never allocates its KV cache. The ModelRunner allocates one pair of tensors
  [num_blocks, block_size, *kv_cache_shape()[0 / 1]] per layer ([..., num_kv_heads, head_dim]
  for both here; MLA declares a latent K and an empty V) and binds it with `bind_kv_cache` before
  the first forward; the runner owns and frees that memory.
- An fp8 KV cache (`--fp8-kvcache`) is e4m3 K/V tensors plus `KVScales` (fp32, one per token and
  KV head), bound together; the kernels quantize on write and dequantize as they read
  (kernels/kv_quant.py). Layers that cannot read one set `supports_fp8_kv_cache = False`.
- Batch layout, positions and slots come from `get_forward_context()` (see forward_context.py).
- q/k/v arrive already projected and rotated, flattened as [T, heads * head_dim]; the output is
  [T, num_heads * head_dim].
- Where FLOTILLA_DENSE_PREFILL allows (default: Hopper and later GPUs), one long prompt without
  a cached prefix attends through torch's fused (cuDNN) attention on its fresh K/V
  (kernels/dense_attention.py); all else reads the paged cache.
- `num_heads` / `num_kv_heads` are this rank's head counts.
- `sinks=True` (gpt-oss) gives the layer a learned sink logit per query head (`sinks`, fp32,
  this rank's heads of the checkpoint's [num_heads]); the kernels add exp(sink) to each
  softmax's denominator. `attention_chunk` (llama4's local layers): a token attends only
  within its chunk of that many positions. Neither takes the fused dense prefill.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla import kernels
from flotilla.kernels.dense_attention import dense_causal_attention, dense_prefill_ok
from flotilla.kernels.kv_quant import KVScales
from flotilla.kernels.selection import Selecting
from flotilla.services.engine.distributed import get_tp_rank
from flotilla.services.engine.forward_context import get_forward_context
from flotilla.services.engine.layers.rotary import RotaryEmbedding


class Attention(nn.Module, Selecting):
    supports_fp8_kv_cache = True

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 sinks: bool = False, attention_chunk: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} "
                             "kv heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.logit_softcap = scale, sliding_window, logit_softcap
        self.attention_chunk = attention_chunk
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_scales: KVScales | None = None
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                      requires_grad=False)
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's heads of the checkpoint's [num_heads] sinks."""
        first = get_tp_rank() * self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] < first + self.num_heads:
            raise ValueError(f"attention sinks of shape {tuple(loaded.shape)} do not hold heads "
                             f"{first}..{first + self.num_heads - 1}")
        param.data.copy_(loaded[first:first + self.num_heads])

    def kv_cache_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-token shapes of this layer's K and V cache entries (a 0 in V's: no V cache)."""
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      kv_scales: KVScales | None = None) -> None:
        """kv_scales: the fp32 scales of e4m3 caches (None: caches in the model dtype)."""
        expected = (self.num_kv_heads, self.head_dim)
        if tuple(k_cache.shape[2:]) != expected or k_cache.shape != v_cache.shape:
            raise ValueError(f"kv cache shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                             f"does not end in (num_kv_heads, head_dim) = {expected}")
        self.k_cache, self.v_cache, self.kv_scales = k_cache, v_cache, kv_scales

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary: RotaryEmbedding | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """With `rotary` (and `positions`), q and k arrive unrotated: one fused kernel rotates
        them and writes the cache (saves a launch per layer in decode)."""
        if self.k_cache.numel() == 0:
            raise RuntimeError("Attention.forward before bind_kv_cache(): the ModelRunner binds it")
        meta = get_forward_context()
        t = q.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        plain = self.sinks is None and self.attention_chunk is None
        sel = self.selection
        if plain and dense_prefill_ok(q, meta, self.kv_scales, self.sliding_window,
                                      self.logit_softcap, sel.dense_prefill):
            # one long prompt without a cached prefix: fused attention on the fresh K/V
            if rotary is not None:
                assert positions is not None, "rotary needs the positions"
                q, k = kernels.rotary_embedding(positions, q, k, rotary.cos_sin_cache,
                                                rotary.is_neox, selection=sel)
            kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                   selection=sel)
            out = dense_causal_attention(q, k, v, self.scale)
            return out.reshape(t, self.num_heads * self.head_dim)
        if rotary is None:
            kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                   self.kv_scales, selection=sel)
        else:
            assert positions is not None, "a fused rotary needs the positions"
            q = kernels.rotary_write_kv_cache(positions, q, k, v, rotary.cos_sin_cache,
                                              rotary.is_neox, self.k_cache, self.v_cache,
                                              meta.slot_mapping, self.kv_scales, selection=sel)
        out = kernels.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale,
                                      sliding_window=self.sliding_window,
                                      logit_softcap=self.logit_softcap, kv_scales=self.kv_scales,
                                      sinks=self.sinks, attention_chunk=self.attention_chunk,
                                      selection=sel)
        return out.reshape(t, self.num_heads * self.head_dim)
