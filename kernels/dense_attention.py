"""Causal attention of one long prompt over its own K/V (no cached prefix) through torch's fused
scaled-dot-product attention, on the fresh contiguous K/V instead of the paged cache.

Why: a 4,096-token prefill of Llama-3-8B spends ~12.6 ms (32 layers) in our Triton
prefill/extend kernel (kernels/prefill_attention.py, ~350 TFLOP/s causal on an H100), where
cuDNN's fused attention (FA3-class: wgmma, TMA) reaches ~520 TFLOP/s on the same shape
(bench/attention_tiles.py). The paged kernel stays for everything else: prompts with a cached
prefix, chunked-prefill continuations, batches of several prompts, decode, fp8 KV caches,
sliding windows and soft-capping.

GQA: cuDNN is asked to take the grouped K/V as they are (enable_gqa); if it refuses, K/V are
expanded to the query heads once per call (two copies of T x Hq x D) and that is remembered.

Shapes: cuDNN builds an execution plan per sequence length (without them built first, the first
2,032-token prompt on an H100 took 701 ms; 51 ms with them), so lengths are padded up to
multiples of BUCKET (zero rows after the prompt: with causal masking no real query sees them)
and `warm_up` builds every bucket's plan at start-up. A prompt takes the fused path only while
the padding adds at most MAX_PAD_COST of attention work (the fused kernel is ~1.4x faster).
The selection's dense_prefill (FLOTILLA_DENSE_PREFILL, kernels/selection.py; the `mode`
argument, see `enabled`): auto, the default, takes the path on Hopper and later GPUs, where it
was measured (H100, B4: 38,478 -> 39,761 tok/s median, paged vs fused in one process); 1 on any
GPU; 0 never (no plan is built and every prompt reads the paged cache). Start-up: 5.5 s with
the plans vs 5.4 s without on an H100 with warm caches. PyTorch keeps these plans per thread: the
engine service's loop thread builds them again before its first step (services/engine/loop.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.kernels.kv_quant import KVScales

log = logging.getLogger(__name__)
DENSE_MIN_TOKENS = 1024  # shorter prompts: the paged kernel (launch-bound there anyway)
BUCKET = 512
MAX_PAD_COST = 1.3
_native_gqa: bool | None = None  # cuDNN takes grouped K/V (None: not tried yet)
_warm_max = 0  # the largest bucket whose plan warm_up built (0: none; CPU needs none)


def padded_len(tokens: int) -> int:
    return -(-tokens // BUCKET) * BUCKET


def enabled(device: torch.device, mode: str = "auto") -> bool:
    """`mode`, the selection's dense_prefill: auto (default) on Hopper and later GPUs, where it
    was measured; 1 on any GPU; 0 off."""
    if mode == "0" or device.type != "cuda":
        return False
    return mode == "1" or torch.cuda.get_device_capability(device)[0] >= 9


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device, max_tokens: int, mode: str = "auto") -> None:
    """Where `enabled` (under the selection's dense_prefill `mode`): build the fused attention
    plan of every bucket a prompt of <= max_tokens can use (the path stays off for lengths
    without a plan)."""
    global _warm_max
    if not enabled(device, mode) or dtype not in (torch.bfloat16, torch.float16):
        return
    for length in range(padded_len(DENSE_MIN_TOKENS), padded_len(max_tokens) + 1, BUCKET):
        q = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(length, num_kv_heads, head_dim, dtype=dtype, device=device)
        try:
            dense_causal_attention(q, k, k, 1.0)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # this build / GPU has no fused kernel for the shape
            log.warning("fused prefill attention unavailable (%s): paged kernel only", exc)
            _warm_max = 0
            return
        _warm_max = length


def dense_prefill_ok(q: torch.Tensor, meta: AttentionMetadata, kv_scales: KVScales | None,
                     sliding_window: int | None, logit_softcap: float | None,
                     mode: str = "auto") -> bool:
    """One sequence whose new tokens are all of its context (no cached prefix), long enough,
    16-bit, on CUDA, with a bf16/fp16 cache and plain causal attention, where the selection's
    dense_prefill `mode` takes the path (`enabled`)."""
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if meta.bounds_only:  # a CUDA-graph capture: no host values to choose by
        return False
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kv_scales is None
            and sliding_window is None and logit_softcap is None and len(seq_lens) == 1
            and qsl[-1] == seq_lens[0] >= DENSE_MIN_TOKENS and q.shape[-1] <= 256):
        return False
    padded = padded_len(seq_lens[0])
    return (padded <= _warm_max and padded ** 2 <= MAX_PAD_COST * seq_lens[0] ** 2
            and enabled(q.device, mode))


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                           ) -> torch.Tensor:
    """q [T, Hq, D], k / v [T, Hk, D] (one sequence, positions 0..T-1) -> [T, Hq, D]; on CUDA
    the length is padded to a multiple of BUCKET (the plan warm_up built)."""
    global _native_gqa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = q.shape[0]
    if q.is_cuda:  # contiguous and bucket-long, as the warmed plans (keyed on strides too)
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, padded_len(t) - t)) if t % BUCKET
                   else x.contiguous() for x in (q, k, v))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D] views
    group = q.shape[1] // k.shape[1]
    backends = [SDPBackend.CUDNN_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        if group > 1 and _native_gqa is not False:
            try:
                out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                     enable_gqa=True)
                _native_gqa = True
                return out[0].transpose(0, 1)[:t]
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                if _native_gqa:  # worked before: a real failure
                    raise
                _native_gqa = False
        if group > 1:
            kh, vh = (t.repeat_interleave(group, dim=1) for t in (kh, vh))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return out[0].transpose(0, 1)[:t]
