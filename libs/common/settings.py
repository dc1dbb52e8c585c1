"""Configuration of every service: pydantic-settings classes sharing the `FLOTILLA_` env prefix.

Each service reads exactly one class here; the launcher, docker-compose.yml and the tests use the
field names below (upper-cased, prefixed) as the only configuration surface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "FLOTILLA_"


class CommonSettings(BaseSettings):
    """Settings every service shares: the bus, shared state, tracing and stream liveness."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    nats_url: str = Field("nats://127.0.0.1:4222",
                          description="NATS server URL(s), comma-separated")
    nats_write_now: bool = Field(
        True, description="Requests and replies go to the NATS socket when published; off = "
        "nats-py's flusher task writes them, after every other ready task (a burst's requests "
        "then leave each hop together, late)")
    gc_freeze: bool = Field(
        True, description="After start-up, move every object Python holds into the garbage "
        "collector's permanent generation (gc.freeze), so full collections, which pause every "
        "thread of the process, do not walk the libraries, the model and the caches each time")
    redis_url: str | None = Field(None, description="Redis URL; unset = in-process store")
    log_level: str = Field("INFO", description="Python logging level")
    otel_exporter: Literal["none", "console", "otlp"] = Field(
        "none", description="Where spans go: nowhere, stderr, or an OTLP collector"
    )
    otel_endpoint: str | None = Field(None, description="OTLP gRPC endpoint, e.g. http://otel:4317")
    heartbeat_interval_s: float = Field(0.5, gt=0, description="Idle stream heartbeat period")
    heartbeat_timeout_s: float = Field(
        3.0, gt=0, description="A stream with no frame for this long is declared dead"
    )
    request_timeout_s: float = Field(
        10.0, gt=0, description="Reply timeout for request/reply calls (not for streams)"
    )
    discovery_interval_s: float = Field(1.0, gt=0, description="Period of service announcements")

    @field_validator("heartbeat_timeout_s")
    @classmethod
    def _timeout_exceeds_interval(cls, v: float, info):  # type: ignore[no-untyped-def]
        interval = info.data.get("heartbeat_interval_s", 0.5)
        if v <= interval:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        return v


class GatewaySettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API")
    spec_path: Path | None = Field(None,
                                   description="OpenAPI spec file; default openapi/flotilla.yaml")
    max_n: int = Field(8, ge=1, le=128, description="Largest `n` (choices per request) accepted")
    model_ttl_s: float = Field(5.0, gt=0, description="A model unseen for this long is unlisted")
    tools_timeout_s: float = Field(2.0, gt=0, description="How long to wait for the MCP tool list")
    tools_cache_ttl_s: float = Field(
        5.0, ge=0, description="How long the MCP tool list is reused (a tools service starting "
        "drops it at once); 0 = ask the tools service for every chat request")
    reasoning_field: Literal["reasoning_content", "reasoning", "both"] = Field(
        "reasoning_content",
        description="Name of the reasoning text in chat messages and deltas (both: send both)")
    gateway_workers: int = Field(
        1, ge=1, le=64, description="Gateway processes sharing the HTTP port, each with its own "
        "event loop and NATS connection (>1 spreads a burst's HTTP, validation and SSE work over "
        "cores; without Redis each keeps its own registry)")


class TokenizerSettings(CommonSettings):
    model: str = Field("default", description="Model path, hub id, or 'default' (SmolLM2)")
    served_model_name: str | None = Field(None, description="Name clients use; derived if unset")
    chat_template: Path | None = Field(None, description="Jinja file overriding the model template")
    max_model_len: int | None = Field(None, ge=16, description="Context length cap in tokens")
    template_timeout_s: float = Field(2.0, gt=0, description="Chat template rendering budget")
    inline_prepare_chars: int = Field(
        2048, ge=0, description="Completion prompts up to this many characters (or token ids), "
        "without a response format, are tokenized on the event loop instead of a worker "
        "thread; 0 = always a thread")


class EngineSettings(CommonSettings):
    model: str = Field("default", description="Model path, hub id, or 'default' (SmolLM2)")
    served_model_name: str | None = Field(None, description="Name clients use; derived if unset")
    engine_id: str | None = Field(None, description="Instance id; random if unset")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weights")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block")
    kvcache_mem_mib: int | None = Field(None, ge=1, description="KV cache size; unset = measured")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU memory share to use")
    max_num_seqs: int = Field(256, ge=1, description="Cap on concurrently running sequences")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget of one step, which also caps the prompt tokens a "
        "step prefills beside the running decodes (chunked prefill); unset = 8192, on CPU 512 "
        "(a long prompt then delays a running stream by ~one 512-token step, not its whole "
        "prefill)")
    prefill_chunk_size: int = Field(8192, ge=0, description="Prefill chunk; 0 = no chunking")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs")
    decode_short_context: int = Field(
        512, ge=0, description="Decode steps of up to 16 sequences, none longer than this "
        "(at most the attention split rule's short bound, checked by EngineConfig), replay CUDA "
        "graphs whose attention splits the KV for short contexts (fewer splits; at 16 rows of 8 "
        "KV heads one split and no reduce kernel); 0 = off")
    pad_eager_steps: bool | None = Field(
        None, description="Run prefill and mixed steps at bucketed row counts whose GEMMs are "
        "warmed at start-up (cuBLAS picks a kernel on the host, 2.5-6 ms, for every new shape); "
        "unset = on CUDA")
    step_graph_tokens: int | None = Field(
        None, ge=0, description="Prefill and mixed steps of up to this many tokens (bucketed) "
        "replay CUDA graphs of the whole step instead of launching ~10 kernels a layer from "
        "Python; unset = 512 on CUDA, 0 = off")
    quantization: str = Field(
        "auto", description="Weights: auto (CPU: int4 for Q4_1 GGUF, else int8; GPU: GGUF blocks "
        "kept) | none | int8 | int4 "
        "| gguf (keep GGUF blocks) | gptq | awq; pre-quantized checkpoints pick their own")
    isq: Literal["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k",
                 "fp8"] | None = Field(None, description="Quantize float weights while loading")
    num_threads: int | None = Field(None, ge=1, description="CPU threads for torch; unset = all")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="Weights: auto (from the files) | dummy (random; benchmarks)")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="KV cache storage: auto (the model dtype) | fp8 (e4m3 with a scale "
        "per token and KV head: ~1.94x the tokens of bf16; not for MLA models)")
    async_scheduling: bool | None = Field(
        None, description="Prepare step N+1 while the device runs step N; unset = on CUDA")
    admit_window_ms: float = Field(
        2.0, ge=0, le=1000, description="When a request wakes an idle engine, wait for more "
        "until this long passes without one (at most admit_window_max_ms), so a burst of "
        "arrivals shares one prefill step; 0 = off")
    admit_window_max_ms: float = Field(
        50.0, ge=0, le=1000, description="Longest wait for a burst's arrivals after the first "
        "woke an idle engine (see admit_window_ms)")
    max_waiting_requests: int = Field(
        256, ge=1, description="Requests that may wait for their first step; past it (or "
        "max_waiting_tokens) a request is refused with 503 and Retry-After")
    max_waiting_tokens: int = Field(
        65536, ge=1, description="Prompt tokens that may wait for their first step (a lone "
        "request is always admitted); past it a request is refused with 503 and Retry-After")
    grammar_cache_entries: int = Field(
        64, ge=1, description="Compiled grammars (structured outputs) kept, least recently "
        "used dropped first")
    grammar_cache_mib: int = Field(
        128, ge=1, description="Memory the compiled-grammar cache may hold, in MiB (a JSON "
        "schema's compiled grammar takes ~1.2 MiB for a 49k-token vocabulary)")
    grammar_compile_workers: int = Field(
        2, ge=1, description="Threads compiling grammars (off the event loop and the step loop)")
    grammar_max_pending: int = Field(
        8, ge=1, description="Grammar compiles queued or running at once; more are refused "
        "with 503 and Retry-After")
    grammar_compile_timeout_s: float = Field(
        5.0, gt=0, description="How long admission waits for a request's grammar to compile; "
        "past it the request is refused with 503 (the compile goes on and is cached)")
    step_log: str | None = Field(
        None, description="File to append one JSON line per engine step to (timing, tokens "
        "scheduled, first tokens out); for looking at how bursts are admitted")
    tp: int | None = Field(
        None, ge=1, description="Tensor-parallel ranks of this pod; unset = one per device id "
        "(or torchrun's WORLD_SIZE), else 1")
    device_ids: str | None = Field(
        None, pattern=r"^\d+(,\d+)*$",
        description="GPU of each rank, comma-separated (e.g. 0,1); unset = GPUs 0..tp-1")
    gemv: Literal["auto", "cublas", "triton"] = Field(
        "auto", description="Unquantized decode GEMVs on CUDA: auto (our Triton GEMV for batch-1 "
        "rows, cuBLAS otherwise) | cublas | triton (ours up to 8 rows)")
    tp_all_reduce: Literal["auto", "nccl", "one_shot", "two_shot"] = Field(
        "auto", description="How GPU tensor-parallel ranks sum small tensors: auto (symmetric-"
        "memory one-shot kernel up to 512 KiB, NCCL above) | nccl | one_shot | two_shot")


class ToolsSettings(CommonSettings):
    mcp_config: Path | None = Field(None, description="mcp.json (Claude Desktop shape)")
    tool_call_timeout_s: float = Field(30.0, gt=0, description="Timeout of one MCP tool call")


class LauncherSettings(CommonSettings):
    model: str = Field("default", description="Model path, hub id, or 'default' (SmolLM2)")
    host: str = Field("127.0.0.1", description="Gateway bind address")
    port: int = Field(8000, ge=0, le=65535, description="Gateway port")
    start_timeout_s: float = Field(600.0, gt=0, description="How long to wait for health")
