"""Builds an Engine from EngineSettings, and engine SamplingParams from bus SamplingOptions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libs.common.messages import SamplingOptions
from libs.common.settings import EngineSettings
from services.engine.engine import Engine, EngineConfig
from services.engine.sampling_params import SamplingParams


def build_engine(settings: EngineSettings, path: Path) -> Engine:
    return Engine(engine_config(settings, path))


def engine_config(settings: EngineSettings, path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype=settings.dtype,
        device=settings.device,
        block_size=settings.block_size,
        kvcache_mem_mib=settings.kvcache_mem_mib,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
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


def to_sampling_params(opts: SamplingOptions, prompt_len: int, max_model_len: int,
                       engine: Any = None) -> SamplingParams:
    """Map the bus's sampling options onto the engine's; raises ValueError on bad values.
    A guided request (structured output) needs the `engine` its grammar compiles for."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"the prompt has {prompt_len} tokens; the context holds {max_model_len}")
    max_tokens = room if opts.max_tokens is None else opts.max_tokens
    if max_tokens > room:
        raise ValueError(f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the "
                         f"context length ({max_model_len})")
    params = SamplingParams(
        temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p,
        seed=opts.seed, max_tokens=max_tokens, stop_token_ids=list(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos, presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty, repetition_penalty=opts.repetition_penalty,
        logprobs=opts.logprobs,
    )
    if opts.guided is not None:
        if engine is None:
            raise ValueError("structured output needs an engine to compile its grammar")
        from services.engine.structured import for_engine

        params.guided = for_engine(engine).request(opts.guided, opts.stop_token_ids,
                                                   opts.ignore_eos)
    return params
