"""Multi-head latent attention (DeepSeek-V2/V3) over a compressed paged cache.

Rules:
- The cache holds, per token, only the compressed KV: the normalised latent c_kv [kv_lora_rank]
  and the rotated shared key part k_pe [qk_rope_head_dim], side by side in one "K" entry of one
  head (`kv_cache_shape` = ((1, kv_lora_rank + rope_dim), (0,)): no V cache). Per-head K and V
  are never stored; they are recovered from the latent through kv_b_proj's weight
  W_kv_b [H * (nope_dim + v_dim), kv_lora_rank] = per head [W_UK; W_UV].
- Prefill / extend (any batch that is not decode-only): per sequence, the cached latent of its
  whole context is decompressed (k_nope = c W_UK^T, v = c W_UV^T), k_pe broadcast to every head,
  and ordinary causal attention runs over it.
- Decode-only batches: absorbed form, vectorised over the batch through the block tables with
  device tensors only (CUDA-graph safe): q_lat = q_nope W_UK (per head, [H, kv_lora_rank]),
  scores = q_lat . c + q_pe . k_pe, out = (softmax(scores) . c) W_UV^T. No per-step
  decompression of the context.
- With the kernel selection's mla_kernel = triton (FLOTILLA_MLA_KERNEL, kernels/selection.py), on
  CUDA every batch runs the absorbed form in Triton (kernels/mla_attention.py: split-KV decode,
  causal extend for prefill / mixed batches) reading the latent cache directly: q_lat = q_nope W_UK
  by one batched matmul, out_lat from the kernel, then out_lat W_UV^T. Opt-in until it is timed
  against the torch paths in the engine: the kernels match their reference on an H200 at DeepSeek-V3
  sizes, and the whole model with every Triton kernel forced (interpreter) matches transformers'
  greedy tokens; the engine-level GPU test that failed on the H200 had a wrong reference
  (transformers treating token 0 as padding). The two torch paths above serve every other case.
- forward(q_nope [T, H, nope], q_pe [T, H, rope] rotated, latent [T, r] normed,
  k_pe [T, rope] rotated, w_kv_b [H*(nope+v), r]) -> [T, H * v]. H is this rank's head count.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flotilla import kernels
from flotilla.kernels.kv_quant import KVScales
from flotilla.kernels.mla_attention import mla_attention_triton
from flotilla.services.engine.forward_context import AttentionMetadata, get_forward_context
from flotilla.services.engine.layers.attention import Attention

SCORES_BYTES = 1 << 28  # bound on the prefill path's fp32 score block per query chunk


def yarn_softmax_mscale(rope_scaling: dict[str, Any] | None) -> float:
    """DeepSeek's YaRN correction of the softmax scale: mscale(factor, mscale_all_dim)^2."""
    if not rope_scaling or rope_scaling.get("rope_type", "default") == "default":
        return 1.0
    all_dim, factor = rope_scaling.get("mscale_all_dim"), float(rope_scaling.get("factor", 1.0))
    if not all_dim or factor <= 1:
        return 1.0
    mscale = 0.1 * float(all_dim) * math.log(factor) + 1.0
    return mscale * mscale


class MLAAttention(Attention):
    supports_fp8_kv_cache = False  # the latent cache stays in the model dtype

    def __init__(self, num_heads: int, nope_dim: int, rope_dim: int, v_dim: int,
                 kv_lora_rank: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank + rope_dim, scale, num_kv_heads=1)
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        self.kv_lora_rank = kv_lora_rank

    def kv_cache_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (1, self.kv_lora_rank + self.rope_dim), (0,)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      kv_scales: KVScales | None = None) -> None:
        if kv_scales is not None:
            raise ValueError("MLA attention has no fp8 KV cache")
        k_shape, _ = self.kv_cache_shape()
        if tuple(k_cache.shape[2:]) != k_shape or v_cache.numel() != 0:
            raise ValueError(f"MLA cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)}: expected "
                             f"[blocks, block_size, {k_shape[0]}, {k_shape[1]}] and an empty V")
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(  # type: ignore[override]
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
        k_pe: torch.Tensor, w_kv_b: torch.Tensor,
    ) -> torch.Tensor:
        if self.k_cache.dim() != 4:
            raise RuntimeError("MLAAttention.forward before bind_kv_cache(): the runner binds it")
        meta = get_forward_context()
        entry = torch.cat([latent, k_pe], dim=-1).unsqueeze(1)  # [T, 1, r + rope]
        # write_kv_cache scatters K and V; MLA has K only, so both arguments are the same.
        kernels.write_kv_cache(entry, entry, self.k_cache, self.k_cache, meta.slot_mapping,
                               selection=self.selection)
        w = w_kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        if self.use_kernel(q_nope):
            out = self._absorbed_triton(q_nope, q_pe, w_uk, w_uv, meta)
        elif meta.is_decode_only:
            out = self._decode(q_nope, q_pe, w_uk, w_uv, meta)
        else:
            out = self._prefill(q_nope, q_pe, w_uk, w_uv, meta)
        return out.reshape(q_nope.shape[0], self.num_heads * self.v_dim)

    def use_kernel(self, t: torch.Tensor) -> bool:
        return (self.selection.mla_kernel == "triton"
                and kernels.use_triton(t, self.selection.kernels))

    def _absorbed_triton(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                         w_uv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # [H, T, nope] x [H, nope, r]: the kernel reads q_lat through its (token, head) strides
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)
        out_lat = mla_attention_triton(q_lat, q_pe, self.k_cache, meta, self.scale)
        out = torch.bmm(out_lat.transpose(0, 1), w_uv.to(out_lat.dtype).transpose(1, 2))
        return out.transpose(0, 1)  # [T, H, v]

    def _context(self, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent and k_pe of every slot of `block_table` [..., n]:
        [..., n * block_size, kv_lora_rank] and [..., n * block_size, rope_dim]."""
        entries = self.k_cache[block_table.long()]  # [..., n, block_size, 1, r + rope]
        entries = entries.flatten(-4, -2)
        return entries[..., : self.kv_lora_rank], entries[..., self.kv_lora_rank :]

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                w_uv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        block_size = self.k_cache.shape[1]
        num_cols = min(-(-meta.max_seq_len // block_size), meta.block_tables.shape[1])
        latent, k_pe = self._context(meta.block_tables[: q_nope.shape[0], :num_cols])
        q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
        scores = (torch.einsum("bhr,blr->bhl", q_lat, latent)
                  + torch.einsum("bhd,bld->bhl", q_pe, k_pe)).float() * self.scale
        positions = torch.arange(latent.shape[1], device=latent.device)
        beyond = positions[None, :] >= meta.seq_lens[: q_nope.shape[0], None]
        probs = scores.masked_fill(beyond[:, None, :], float("-inf")).softmax(-1)
        out_lat = torch.einsum("bhl,blr->bhr", probs.to(latent.dtype), latent)
        return torch.einsum("bhr,hvr->bhv", out_lat, w_uv)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                 w_uv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        block_size = self.k_cache.shape[1]
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i, seq_len in enumerate(lens):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            table = meta.block_tables[i, : -(-seq_len // block_size)]
            latent, k_pe = (t[:seq_len] for t in self._context(table))
            k_nope = torch.einsum("lr,hdr->hld", latent, w_uk)
            v = torch.einsum("lr,hvr->hlv", latent, w_uv)
            k = torch.cat([k_nope, k_pe[None].expand(self.num_heads, -1, -1)], dim=-1)
            keys = torch.arange(seq_len, device=k.device)
            # Query rows in chunks, so the fp32 scores [H, rows, L] stay under SCORES_BYTES.
            rows = max(1, SCORES_BYTES // (4 * self.num_heads * seq_len))
            for a in range(lo, hi, rows):
                b = min(a + rows, hi)
                q = torch.cat([q_nope[a:b], q_pe[a:b]], dim=-1).transpose(0, 1)
                q_pos = seq_len - (hi - a) + torch.arange(b - a, device=k.device)
                scores = torch.matmul(q, k.transpose(1, 2)).float() * self.scale
                hidden = keys[None, :] > q_pos[:, None]
                probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
                out[a:b] = torch.matmul(probs.to(v.dtype), v).transpose(0, 1)
        return out

