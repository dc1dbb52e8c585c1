"""Configuration of every service: pydantic-settings classes sharing the `FLOTILLA_` env prefix.

Each service reads exactly one class here; the launcher, docker-compose.yml and the tests use the
field names below (upper-cased, prefixed) as the only configuration surface. What every service
shares (CommonSettings, ModelCacheSettings) lives in common_settings.py and the gateway's class
in gateway_settings.py; both are re-exported here, the one place to import settings from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from flotilla.libs.common.common_settings import ENV_PREFIX, CommonSettings, ModelCacheSettings
from flotilla.libs.common.gateway_settings import GatewaySettings

__all__ = ["ENV_PREFIX", "CommonSettings", "EngineSettings", "GatewaySettings",
           "LauncherSettings", "ModelCacheSettings", "TokenizerSettings", "ToolsSettings"]


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
    num_state_slots: int | None = Field(
        None, ge=1, description="Hybrid (linear-attention) models: sequences whose recurrent "
        "state the state pool holds, i.e. that run at once; unset = max_num_seqs, capped so the "
        "states take at most half of the KV-cache memory budget")
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
    w4_layout: Literal["kmajor", "marlin", "both"] = Field(
        "kmajor", description="GPTQ / AWQ weights on CUDA: kmajor (K-order 4-bit words; the "
        "fastest batch-1 decode) | marlin (re-packed for the tensor-core GEMM: faster batched "
        "decode, slower batch-1; H100 Llama-3-8B: B16 1.21x, B1 0.58x of kmajor) | both (each "
        "layout where it is faster: twice the 4-bit weights' memory)")
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
