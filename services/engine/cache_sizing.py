"""How much cache the model runner allocates: KV blocks and linear-attention state slots.

Rules:
- The KV cache is allocated once: per attention layer a K and a V tensor [num_blocks, block_size,
  *shape] in the KV dtype with the shapes the layer declares (`kv_cache_shape()`: (Hk, D) for
  both, or MLA's latent K and empty V), bound to the layer; with an fp8 cache the K/V tensors
  are e4m3 with fp32 scales [num_blocks, block_size, Hk] beside them (kernels/kv_quant.py), and
  the block count grows with the bytes saved.
- Its size is an explicit block count, an explicit MiB size, or (on CUDA) what
  `gpu_memory_utilization` of the GPU leaves after the weights and a profiling forward at the
  largest step (the runner runs it: `profile_requests`, `budget_after_peak`); on CPU without
  either, DEFAULT_CPU_KVCACHE_MIB.
- Hybrid models (linear-attention layers) also get a state pool (state_pool.py:
  `num_state_slots` slots, max_num_seqs unless the config names fewer, capped so the states
  take at most half of the memory budget), allocated before the KV cache is sized so the KV
  budget is what the states leave. Every tensor-parallel rank takes the smallest count of all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from flotilla.kernels.kv_quant import KVScales
from flotilla.services.engine.distributed import tp_min
from flotilla.services.engine.layers.attention import Attention
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import ScheduledRequest
from flotilla.services.engine.state_pool import StateLayer, fit_state_slots, state_bytes_per_slot

if TYPE_CHECKING:
    from flotilla.services.engine.config import EngineConfig

log = logging.getLogger(__name__)

DEFAULT_CPU_KVCACHE_MIB = 512


def kv_bytes_per_block(attention: Sequence[Attention], kv_dtype: torch.dtype, block_size: int,
                       fp8: bool) -> int:
    """Cache bytes of one block over all layers: K and V entries, plus with fp8 one fp32
    scale per (token, KV head) of each."""
    elem = torch.empty(0, dtype=kv_dtype).element_size()
    shapes = [a.kv_cache_shape() for a in attention]
    per_token = sum(math.prod(k) + math.prod(v) for k, v in shapes) * elem
    if fp8:
        per_token += sum(k[0] + v[0] for k, v in shapes) * 4
    return per_token * block_size


def num_state_slots(config: EngineConfig, state_layers: Sequence[StateLayer],
                    dtype: torch.dtype, device: torch.device) -> int:
    """config.num_state_slots (None: max_num_seqs), capped to half the memory budget where
    the KV cache is sized from one (an explicit block count is the KV cache alone)."""
    wanted = config.num_state_slots or config.max_num_seqs
    if config.num_kv_blocks is not None:
        return wanted
    if config.kvcache_mem_mib is not None:
        budget = config.kvcache_mem_mib * (1 << 20)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
    else:
        budget = DEFAULT_CPU_KVCACHE_MIB * (1 << 20)
    per_slot = state_bytes_per_slot(state_layers, dtype)
    return tp_min(fit_state_slots(wanted, per_slot, budget))


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int,
                  state_bytes: int, profile: Callable[[float], int]) -> int:
    """The block count the config asks for or its budget holds after the state pool;
    `profile(gpu_memory_utilization)` measures the budget on CUDA (the pool already counts)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kvcache_mem_mib is not None:
        budget = config.kvcache_mem_mib * (1 << 20) - state_bytes
    elif device.type == "cuda":
        budget = profile(config.gpu_memory_utilization)
    else:
        budget = DEFAULT_CPU_KVCACHE_MIB * (1 << 20) - state_bytes
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"no room for a KV cache ({budget / 2**20:.1f} MiB left); lower the "
                         "batch limits or raise gpu_memory_utilization / kvcache_mem_mib")
    return int(num_blocks)


def allocate_kv_cache(attention: Sequence[Attention], num_blocks: int, block_size: int,
                      kv_dtype: torch.dtype, fp8: bool, device: torch.device
                      ) -> list[torch.Tensor]:
    """Every layer's cache tensors (K, V and fp8 scales), bound to their layers."""
    caches = []
    for layer in attention:
        k_shape, v_shape = layer.kv_cache_shape()
        k, v = (torch.zeros(num_blocks, block_size, *shape, dtype=kv_dtype, device=device)
                for shape in (k_shape, v_shape))
        scales = None
        if fp8:
            scales = KVScales(*(torch.ones(num_blocks, block_size, shape[0], device=device)
                                for shape in (k_shape, v_shape)))
            caches += list(scales)
        layer.bind_kv_cache(k, v, scales)
        caches += [k, v]
    return caches


def unbind_kv_cache(attention: Sequence[Attention], device: torch.device) -> None:
    """Drop the layers' references to their cache (the profiling one), binding empty ones."""
    for layer in attention:
        k_shape, v_shape = layer.kv_cache_shape()
        layer.bind_kv_cache(torch.empty(0, 1, *k_shape, device=device),
                            torch.empty(0, 1, *v_shape, device=device))


def dummy_request(request_id: str, num_tokens: int, block_ids: list[int], state_slot: int = 0
                  ) -> ScheduledRequest:
    """A prefill of `num_tokens` zeros into `block_ids` (profiling and warm-up steps)."""
    return ScheduledRequest(
        request_id=request_id, token_ids=[0] * num_tokens, num_computed_tokens=0,
        block_ids=block_ids, is_prefill=True, samples=True, sampling_params=SamplingParams(),
        generator=None, prompt_len=num_tokens, all_token_ids=[0] * num_tokens,
        state_slot=state_slot,
    )


def profile_requests(max_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int,
                     num_state_slots: int) -> tuple[list[ScheduledRequest], int, int]:
    """The profiling step: the largest step's tokens as prompts of up to max_model_len, as many
    sequences as that takes (at most max_num_seqs). Returns the requests, the blocks they use
    and the blocks one of them spans; num_state_slots 0: no state slots."""
    seq_len = min(max_tokens, max_model_len)
    num_seqs = min(max_num_seqs, -(-max_tokens // seq_len))
    blocks_per_seq = -(-seq_len // block_size)
    requests, left = [], max_tokens
    for i in range(num_seqs):
        n = min(seq_len, left)
        left -= n
        blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        slot = i % num_state_slots if num_state_slots else -1
        requests.append(dummy_request(f"profile-{i}", n, blocks, slot))
    return requests, -(-max_tokens // block_size) + num_seqs, blocks_per_seq


def budget_after_peak(device: torch.device, utilization: float) -> int:
    """Bytes left for the KV cache under `utilization` of the GPU, after the peak allocated
    since the last reset and what other processes hold."""
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - peak - others
    log.info("KV cache budget %.0f MiB (peak %.0f MiB, other %.0f MiB, total %.0f MiB)",
             budget / 2**20, peak / 2**20, others / 2**20, total / 2**20)
    return max(budget, 0)
