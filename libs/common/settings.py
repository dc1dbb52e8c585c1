"""Configuration of every service: pydantic-settings classes sharing the `FLOTILLA_` env prefix.

Each service reads exactly one class here; the launcher, docker-compose.yml and the tests use the
field names below (upper-cased, prefixed) as the only configuration surface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "FLOTILLA_"


class ModelCacheSettings(BaseSettings):
    """Where models are kept; read by libs/common/model_cache.py (every service and the library
    resolve model names through it)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    cache_dir: Path | None = Field(
        None, description="Model cache (the default model, hub downloads); unset = "
        "$XDG_CACHE_HOME/flotilla, else ~/.cache/flotilla")


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
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of the Prometheus /metrics endpoint of the "
        "tokenizer, engine and tools services (the gateway serves /metrics on its API port and "
        "ignores this); 0 = off (`flotilla up` and docker-compose.yml turn it on)")
    metrics_host: str = Field(
        "127.0.0.1", description="Address the metrics port binds (0.0.0.0 in containers)")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="On SIGTERM a service stops taking new work and waits this long "
        "for the work in flight (open streams) to finish before it exits; SIGINT, or a second "
        "signal, stops at once. Container stop grace periods must exceed it")
    # ---- a closed bus (docs/security.md): every NATS connection of every service uses these
    nats_user: str | None = Field(None, description="NATS user name (with nats_password)")
    nats_password: SecretStr | None = Field(None, description="NATS password of nats_user")
    nats_token: SecretStr | None = Field(None, description="NATS authentication token (instead "
                                         "of a user and password)")
    nats_nkey_seed: Path | None = Field(None, description="File holding this service's NATS "
                                        "nkey seed (SU...), instead of a password or token")
    nats_tls_ca: Path | None = Field(None, description="CA certificate (PEM) that signed the "
                                     "NATS server's certificate; set = connect with TLS")
    nats_tls_cert: Path | None = Field(None, description="Client certificate (PEM) for NATS "
                                       "servers that verify clients (with nats_tls_key)")
    nats_tls_key: Path | None = Field(None, description="Private key of nats_tls_cert")

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
    ready_probe_timeout_s: float = Field(
        1.5, gt=0, description="/ready: how long each tokenizer, engine and tools instance has "
        "to answer its health probe; one that does not (frozen, wedged event loop) is not ready")
    engine_stall_s: float = Field(
        10.0, gt=0, description="/ready: an engine whose step loop has not gone round for this "
        "long (one step longer than this, or a wedged loop) is not ready")
    tools_timeout_s: float = Field(2.0, gt=0, description="How long to wait for the MCP tool list")
    tools_cache_ttl_s: float = Field(
        5.0, ge=0, description="How long the MCP tool list is reused (a tools service starting "
        "drops it at once); 0 = ask the tools service for every chat request")
    reasoning_field: Literal["reasoning_content", "reasoning", "both"] = Field(
        "reasoning_content",
        description="Name of the reasoning text in chat messages and deltas (both: send both)")
    mcp_call_timeout_s: float = Field(
        35.0, gt=0, description="How long the gateway waits for one MCP tool call it runs (the "
        "tools service's own per-call timeout, FLOTILLA_TOOL_CALL_TIMEOUT_S, should be shorter: "
        "the model then gets its timeout error as the call's result)")
    mcp_max_iterations: int = Field(
        8, ge=1, le=64, description="Model turns that may call MCP tools in one answer of the "
        "agent loop (/v1/responses, chat with injected tools); the turn after the last one "
        "runs without tools, so the model answers with what it has")
    responses_ttl_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="How long stored responses (/v1/responses with "
        "store, the default) are kept; in Redis when FLOTILLA_REDIS_URL is set")
    conversations_ttl_s: float = Field(
        30 * 24 * 3600.0, gt=0, description="How long a conversation (/v1/conversations) is kept "
        "after its last change; in Redis when FLOTILLA_REDIS_URL is set")
    conversation_max_items: int = Field(
        1000, ge=1, description="Most items one conversation may hold; adding more is a 400")
    conversation_max_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Most bytes (its items as JSON) one conversation "
        "may hold; adding more is a 400")
    gateway_workers: int = Field(
        1, ge=1, le=64, description="Gateway processes sharing the HTTP port, each with its own "
        "event loop and NATS connection (>1 spreads a burst's HTTP, validation and SSE work over "
        "cores; without Redis each keeps its own registry)")
    # ---- limits on one request (docs/architecture.md, "Limits and overload")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body in bytes; larger is 413 "
        "(a Content-Length above it before any byte is read)")
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request line plus headers in bytes; larger is "
        "431 and the connection closes, before the rest is read")
    max_headers: int = Field(100, ge=8, description="Most header fields in one request; more is "
                             "431 and the connection closes")
    max_json_depth: int = Field(
        128, ge=8, le=1000, description="Deepest nesting of arrays and objects in a JSON body; "
        "deeper is 400")
    max_messages: int = Field(2048, ge=1, description="Most chat messages in one request")
    max_tools: int = Field(128, ge=1, description="Most tools in one request (OpenAI's limit)")
    max_schema_bytes: int = Field(
        64 * 1024, ge=256, description="Largest JSON of one tool's function (name, description, "
        "parameters schema) or of a response_format; larger is 400")
    max_stop: int = Field(16, ge=1, description="Most stop strings in one request")
    max_stop_chars: int = Field(512, ge=1, description="Longest stop string, in characters")
    max_prompts: int = Field(64, ge=1, description="Most prompts in one /v1/completions request "
                             "(each with `n` choices)")
    max_embedding_inputs: int = Field(
        2048, ge=1, description="Most inputs in one /v1/embeddings request (OpenAI's limit), "
        "and most texts or documents in one score / rerank request")
    max_embedding_tokens: int = Field(
        300_000, ge=1, description="Most tokens the inputs of one embeddings, score or rerank "
        "request may hold together (OpenAI's limit); more is 400")
    # ---- overload control
    max_in_flight: int = Field(
        512, ge=1, description="Generation and tokenize requests one gateway process serves at "
        "once (a stream counts until it ends); beyond it 503 with Retry-After, never a queue")
    overload_retry_after_s: float = Field(
        1.0, gt=0, description="Retry-After sent with the gateway's own 503 when it is full")
    request_deadline_s: float = Field(
        600.0, gt=0, description="Longest a request may run (a client's X-Request-Timeout may "
        "ask for less); past it the gateway ends the response with a 504 / an error event and "
        "cancels the request on every hop")
    ui: bool = Field(False, description="Serve the chat web UI at / (same port and origin as "
                     "the API; its files ship in the package)")
    prometheus_multiproc_dir: Path | None = Field(
        None, validation_alias="PROMETHEUS_MULTIPROC_DIR", description="Directory where "
        "several gateway worker processes keep their metrics (prometheus-client's multiprocess "
        "mode, under its own variable's name); the parent of FLOTILLA_GATEWAY_WORKERS > 1 sets "
        "it for its workers. Unset = this process's metrics only")
    # ---- API keys and per-key limits (docs/security.md)
    api_keys: SecretStr | None = Field(
        None, description="API keys the gateway accepts, comma-separated (only their SHA-256 "
        "is kept); any key set here, in api_key_file or require_api_key turns authentication on")
    api_key_file: Path | None = Field(
        None, description="File of API keys, one a line (`#` starts a comment); a line may be "
        "`sha256:<hex>`, the key's SHA-256, so the file need not hold the key itself")
    require_api_key: bool = Field(
        False, description="Require an API key even when none is set here: the keys are the "
        "ones made with `flotilla keys create` (in Redis)")
    auth_open_paths: str = Field(
        "/health,/ready,/metrics", description="Paths answered without a key, comma-separated "
        "(GET / and /ui/*, the chat UI's page and files, always are)")
    key_rpm: int | None = Field(None, ge=1, description="Requests per minute of each key set "
                                "in api_keys / api_key_file; unset = unlimited")
    key_tpm: int | None = Field(None, ge=1, description="Tokens per minute (prompt + generated) "
                                "of each key set in api_keys / api_key_file; unset = unlimited")
    key_max_concurrent: int | None = Field(None, ge=1, description="Requests in flight at once "
                                           "per key set in api_keys / api_key_file")
    key_reserve_output_tokens: int = Field(
        1024, ge=1, description="Tokens per choice a keyed request that names no max_tokens "
        "reserves for its output against its tokens-per-minute limit (settled to the real "
        "count when it ends)")
    cors_origins: str | None = Field(
        None, description="Origins allowed to call the API from a browser, comma-separated "
        "(`*` = any); unset = no CORS headers (the chat UI is same-origin and needs none)")


class TokenizerSettings(CommonSettings):
    model: str = Field("default", description="Model path, hub id, or 'default' (SmolLM2)")
    served_model_name: str | None = Field(None, description="Name clients use; derived if unset")
    chat_template: Path | None = Field(None, description="Jinja file overriding the model template")
    max_model_len: int | None = Field(
        None, ge=16, description="Context length cap in tokens (the engines' published context "
        "length, when smaller, wins)")
    template_timeout_s: float = Field(
        2.0, gt=0, description="Chat template rendering budget, timed from when a worker "
        "starts rendering (never the wait before); an overrun is a 503 with Retry-After")
    workers: int = Field(4, ge=1, description="Threads rendering and tokenizing ordinary "
                         "requests (the light lane)")
    heavy_workers: int = Field(
        1, ge=1, description="Threads for heavy requests (more than heavy_tools tools or "
        "heavy_chars characters), so they cannot take the light lane's threads")
    grammar_workers: int = Field(1, ge=1, description="Threads checking grammars and schemas")
    queue_size: int = Field(256, ge=0, description="Waiting requests the light lane holds; "
                            "beyond it a 503 with Retry-After")
    heavy_queue_size: int = Field(8, ge=0, description="Waiting requests of the heavy lane")
    grammar_queue_size: int = Field(16, ge=0, description="Waiting grammar checks")
    queue_wait_s: float = Field(
        2.0, gt=0, description="Longest wait of a request for a worker thread; past it a 503 "
        "with Retry-After")
    grammar_timeout_s: float = Field(
        4.0, gt=0, description="Longest grammar / schema check (after its wait for a thread); "
        "past it a 503 with Retry-After (the check finishes and is cached for a retry)")
    grammar_cache_size: int = Field(
        512, ge=0, description="Checked guided-decoding specs remembered (LRU), keyed by what "
        "they were built from")
    grammar_cache_mib: int = Field(64, ge=0, description="Size bound of that cache")
    heavy_tools: int = Field(32, ge=0, description="Requests with more tools go to the heavy "
                             "lane")
    heavy_chars: int = Field(
        32_768, ge=0, description="Requests whose messages / prompt and tools hold more "
        "characters go to the heavy lane")
    max_tools: int = Field(256, ge=0, description="Most tools a request may carry (400 above)")
    max_tools_chars: int = Field(
        524_288, ge=0, description="Most characters a request's tools may hold as JSON (400)")
    max_prompt_chars: int = Field(
        4_000_000, ge=1, description="Most characters of a prompt, before and after the chat "
        "template (400 above)")
    score_mode: Literal["auto", "embedding", "qwen3_reranker"] = Field(
        "auto", description="How /v1/score and /v1/rerank score a pair: embedding (cosine "
        "similarity of the two embeddings) | qwen3_reranker (Qwen3-Reranker's yes / no judging "
        "prompt, P(yes)); auto: qwen3_reranker when the checkpoint is a reranker (its "
        "config, model card or sentence-transformers files; else its name)")
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
    max_model_len: int | None = Field(
        None, ge=16, description="Context length cap in tokens; the engine's context length is "
        "the smallest of this, the model's own and what the KV cache holds, and it publishes "
        "that number (the tokenizer and /v1/models use it)")
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
    num_experts_offload_per_rank: int = Field(
        0, ge=0, description="MoE expert offload: keep the last N experts of each tensor-"
        "parallel rank in every MoE layer in host memory (e.g. DeepSeek-R1 on 8 GPUs with 15 "
        "a rank); the rest of the model stays on the GPU; any offload runs the engine eagerly")
    cpu_moe: bool = Field(
        False, description="MoE expert offload as llama.cpp's --cpu-moe: every expert of every "
        "MoE layer in host memory")
    n_cpu_moe: int = Field(
        0, ge=0, description="MoE expert offload as llama.cpp's --n-cpu-moe N: every expert of "
        "decoder layers 0..N-1 in host memory")
    moe_offload_mode: Literal["cpu", "stream"] = Field(
        "cpu", description="How offloaded experts run: cpu (on CPU threads from their host "
        "copy, kept quantized where the format has a CPU kernel; the routed rows go to the host "
        "and back) | stream (copied to the GPU each step they are used)")
    # ---- kernel selection (kernels/selection.py: one object the engine builds from these)
    gemv: Literal["auto", "cublas", "triton"] = Field(
        "auto", description="Unquantized decode GEMVs on CUDA: auto (our Triton GEMV for batch-1 "
        "rows, cuBLAS otherwise) | cublas | triton (ours up to 8 rows)")
    kernels: Literal["auto", "torch"] = Field(
        "auto", description="auto: Triton kernels on CUDA | torch: the torch reference of every "
        "op even on CUDA (debugging, A/B comparisons)")
    quant_kernels: Literal["auto", "triton", "torch"] = Field(
        "auto", description="Quantized layers: auto (packed weights and Triton kernels on CUDA, "
        "dequantized float weights on CPU) | triton (the kernels everywhere; on CPU under "
        "TRITON_INTERPRET=1, for tests) | torch (dequantized weights everywhere)")
    fp8_gemv: Literal["auto", "fma", "mma"] = Field(
        "auto", description="fp8 decode GEMV: auto (CUDA cores for one row, tensor cores for "
        "two) | fma (CUDA cores) | mma (tensor cores), each where it can run")
    gated_gemm: Literal["auto", "0", "1"] = Field(
        "auto", description="Gated MLPs' gate/up projection with SiLU·mul in the GEMM's epilogue: "
        "auto (prefill-sized 16-bit inputs on Hopper and later) | 1 (any CUDA input it takes) "
        "| 0 (cuBLAS + SiLU·mul)")
    dense_prefill: Literal["auto", "0", "1"] = Field(
        "auto", description="cuDNN fused attention for long prompts without a cached prefix: "
        "auto (Hopper and later) | 1 (any GPU) | 0 (the paged Triton kernel)")
    pdl: Literal["auto", "0", "1"] = Field(
        "auto", description="Programmatic dependent launch of the decode kernels: auto / 1 "
        "(GPUs of compute capability 9.0+) | 0 (off)")
    mla_kernel: Literal["torch", "triton"] = Field(
        "torch", description="MLA attention (DeepSeek-V2/V3): torch | triton "
        "(kernels/mla_attention.py over the latent cache; opt-in)")
    prefill_tile: str | None = Field(
        None, pattern=r"^\d+,\d+,\d+,\d+$", description="Prefill attention tile "
        "'block_m,block_n,num_warps,num_stages' instead of the tuned defaults (benchmark sweeps)")
    tp_all_reduce: Literal["auto", "nccl", "one_shot", "two_shot"] = Field(
        "auto", description="How GPU tensor-parallel ranks sum small tensors: auto (symmetric-"
        "memory one-shot kernel up to 512 KiB, NCCL above) | nccl | one_shot | two_shot")
    pooling: Literal["auto", "last", "mean", "cls"] = Field(
        "auto", description="How embeddings (and score / rerank) pool the hidden states: auto "
        "(the checkpoint's sentence-transformers Pooling config, else the last token, as for "
        "decoder embedders such as Qwen3-Embedding) | last | mean | cls")


class ToolsSettings(CommonSettings):
    mcp_config: Path | None = Field(None, description="mcp.json (Claude Desktop shape)")
    tool_call_timeout_s: float = Field(30.0, gt=0, description="Timeout of one MCP tool call")
    tool_result_max_chars: int = Field(
        65536, ge=256, description="A tool result longer than this is cut (with a note saying "
        "so), so one tool cannot flood the model's context or the bus")


class LauncherSettings(CommonSettings):
    model: str = Field("default", description="Model path, hub id, or 'default' (SmolLM2)")
    served_model_name: str | None = Field(None, description="Name clients use; derived if unset")
    run_dir: Path | None = Field(
        None, description="Where `flotilla up` writes its state files and `flotilla status` looks "
        "for them; unset = <temp dir>/flotilla-<uid>")
    host: str = Field("127.0.0.1", description="Gateway bind address")
    port: int = Field(8000, ge=0, le=65535, description="Gateway port")
    start_timeout_s: float = Field(600.0, gt=0, description="How long to wait for health")
    ui: bool = Field(False, description="The gateway serves the chat web UI at /")
    nats_auth: bool = Field(True, description="A private nats-server requires a password "
                            "(generated for each start, given to the services, never logged)")
