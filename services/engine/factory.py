"""Builds an Engine from EngineSettings."""

from __future__ import annotations

from pathlib import Path

from libs.common.settings import EngineSettings
from services.engine.engine import Engine, EngineConfig


def build_engine(settings: EngineSettings, path: Path) -> Engine:
    return Engine(engine_config(settings, path))


def engine_config(settings: EngineSettings, path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype=settings.dtype,
        device=settings.device,
        max_model_len=settings.max_model_len,
        block_size=settings.block_size,
        kvcache_mem_mib=settings.kvcache_mem_mib,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens or 0,
        prefill_chunk_size=settings.prefill_chunk_size,
        enable_prefix_caching=settings.enable_prefix_caching,
        enforce_eager=settings.enforce_eager,
        decode_short_context=settings.decode_short_context,
        pad_eager_steps=settings.pad_eager_steps,
        step_graph_tokens=settings.step_graph_tokens,
        quantization=None if settings.quantization == "none" else settings.quantization,
        isq=settings.isq,
        num_threads=settings.num_threads,
        load_format=settings.load_format,
        kv_cache_dtype=settings.kv_cache_dtype,
        async_scheduling=settings.async_scheduling,
        tp=settings.tp,
        tp_all_reduce=settings.tp_all_reduce,
        gemv=settings.gemv,
        device_ids=(tuple(int(i) for i in settings.device_ids.split(","))
                    if settings.device_ids else None),
    )
