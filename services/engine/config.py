"""EngineConfig: what an Engine is built from (the service maps its settings onto it,
services/engine/factory.py), its checks, and the values its "auto" / None fields resolve to."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flotilla.kernels.paged_attention import SHORT_SPLIT_KEYS
from flotilla.kernels.selection import KernelSelection
from flotilla.services.engine.layers.moe_offload import ExpertOffload, OffloadMode
from flotilla.services.engine.loader import CPU_DEFAULT

# Steps up to here are host-bound on an H100 host with a Llama-3-8B (bench/shape_probe.py, a probe
# now in git history); past it the GPU's share grows and each graph costs capture time.
DEFAULT_STEP_GRAPH_TOKENS = 512
# The step token budget when none is given. On CPU a step's time grows with its tokens, and a
# running stream waits for every step: with 512 a 3,000-token prompt stalled another stream for
# 4.6 s instead of 21 s (SmolLM2-135M, 1 thread on the shared 2-core box) at the same time to
# first token for the long prompt (bench/cpu_engine.py, docs/benchmarks.md). 256 halved the
# stall again, but the budget must stay above max_num_seqs (256): decodes are scheduled first,
# one token each, and a full batch of them would leave no room for any prefill.
DEFAULT_TOKEN_BUDGET = 8192
DEFAULT_CPU_TOKEN_BUDGET = 512
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """model: path, hub id or "default". dtype/device "auto": bfloat16 on CUDA, float32 on CPU.

    KV cache size: num_kv_blocks, else kvcache_mem_mib, else (CUDA) gpu_memory_utilization of the
    GPU after weights and a profiling forward, else (CPU) 512 MiB. max_model_len (None: the
    model's) is lowered to what the KV cache can hold.
    """

    model: str = "default"
    dtype: torch.dtype | str = "auto"
    device: str = "auto"
    block_size: int = 16
    kvcache_mem_mib: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    # the step's token budget, which also caps the prefill tokens a step takes beside its decodes
    # (0: DEFAULT_TOKEN_BUDGET, on CPU DEFAULT_CPU_TOKEN_BUDGET unless chunking is off)
    max_num_batched_tokens: int = 0
    prefill_chunk_size: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # decode steps of <= 16 sequences, each <= this many tokens, replay short-context CUDA graphs
    # (services/engine/cuda_graphs.py); 0 = off
    decode_short_context: int = 512
    num_kv_blocks: int | None = None
    # hybrid (linear-attention) models: sequences whose recurrent state the state pool holds,
    # i.e. that run at once (None: max_num_seqs, capped to half the memory budget;
    # services/engine/state_pool.py)
    num_state_slots: int | None = None
    # eager steps run bucketed row counts, their GEMMs warmed at start-up
    # (services/engine/row_buckets.py); None: on CUDA
    pad_eager_steps: bool | None = None
    # prefill and mixed steps of up to this many (bucketed) tokens replay CUDA graphs of the
    # whole step (services/engine/step_graphs.py); None: 512 on CUDA with padded steps, 0 = off
    step_graph_tokens: int | None = None
    # weight quantization by name (services/engine/quant); "auto": weight-only on CPU (batch-1
    # decode there is bound by weight bytes: int4 for a Q4_1 GGUF, else int8), none on GPU
    quantization: str | None = None
    # in-situ quantization of a float checkpoint while loading (services/engine/quant/isq.py):
    # q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k fp8; takes precedence over `quantization`
    isq: str | None = None
    load_format: str = "auto"  # "dummy": config.json only, random weights (benchmarks)
    # KV cache storage: "auto" (the model dtype) | "fp8" (e4m3 with one fp32 scale per token and
    # KV head, ~1.94x the tokens of bf16 at head_dim 128; kernels/kv_quant.py)
    kv_cache_dtype: str = "auto"
    async_scheduling: bool | None = None  # overlap host work with the device (None: on CUDA)
    # which kernel serves each op where there is a choice (kernels/selection.py): every model
    # runner installs it for its process before it builds the model
    kernel_selection: KernelSelection = field(default_factory=KernelSelection)
    num_threads: int | None = None  # CPU: torch intra-op threads (None: torch's default)
    seed: int | None = None  # seeds the shared RNG of unseeded requests
    # tensor parallelism (services/engine/executor.py): tp ranks (None: one per device id, or
    # torchrun's WORLD_SIZE, else 1); rank r on GPU device_ids[r] (None: GPU r)
    tp: int | None = None
    device_ids: tuple[int, ...] | None = None
    # how NCCL pods sum small tensors: auto | nccl | one_shot | two_shot
    # (services/engine/symm_all_reduce.py)
    tp_all_reduce: str = "auto"
    # how embeddings pool hidden states: auto (the checkpoint's sentence-transformers config,
    # else last token) | last | mean | cls (services/engine/pooling_config.py)
    pooling: str = "auto"
    # MoE experts in host memory (services/engine/layers/moe_offload.py): the last N experts of
    # each rank in every MoE layer; all experts of every layer (llama.cpp's --cpu-moe); all
    # experts of decoder layers 0..n_cpu_moe-1 (--n-cpu-moe); how they run: cpu | stream.
    # Any offload makes the engine eager (the routing goes to the host each step).
    num_experts_offload_per_rank: int = 0
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    moe_offload_mode: OffloadMode = "cpu"

    def __post_init__(self) -> None:
        if self.expert_offload.active:
            self.enforce_eager = True
        if self.max_num_batched_tokens == 0:
            cpu = self.resolved_device == "cpu" and self.prefill_chunk_size > 0
            self.max_num_batched_tokens = DEFAULT_CPU_TOKEN_BUDGET if cpu else DEFAULT_TOKEN_BUDGET
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 <= self.decode_short_context <= SHORT_SPLIT_KEYS:
            raise ValueError(f"decode_short_context must be in [0, {SHORT_SPLIT_KEYS}] (0 disables "
                             "short graphs; longer contexts take the long graphs' split rule)")
        if self.prefill_chunk_size < 0:
            raise ValueError("prefill_chunk_size must be >= 0 (0 disables chunking)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.tp_all_reduce not in ("auto", "nccl", "one_shot", "two_shot"):
            raise ValueError("tp_all_reduce must be auto, nccl, one_shot or two_shot, got "
                             f"{self.tp_all_reduce!r}")
        if self.step_graph_tokens is not None and self.step_graph_tokens < 0:
            raise ValueError(f"step_graph_tokens must be >= 0, got {self.step_graph_tokens}")
        if self.pooling not in ("auto", "last", "mean", "cls"):
            raise ValueError(f"pooling must be auto, last, mean or cls, got {self.pooling!r}")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {self.num_state_slots}")
        if self.tp is not None and self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    @property
    def expert_offload(self) -> ExpertOffload:
        return ExpertOffload(self.num_experts_offload_per_rank, self.cpu_moe, self.n_cpu_moe,
                             self.moe_offload_mode)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_quantization(self) -> str | None:
        if self.isq:
            return self.isq
        if self.quantization != "auto":
            return self.quantization
        return None if self.resolved_device.startswith("cuda") else CPU_DEFAULT

    @property
    def resolved_pad_eager_steps(self) -> bool:
        if self.pad_eager_steps is not None:
            return self.pad_eager_steps
        return self.resolved_device.startswith("cuda")

    @property
    def resolved_step_graph_tokens(self) -> int:
        """0 without CUDA graphs or padded steps (an unpadded step's row count is rarely a
        bucket), else the setting (None: DEFAULT_STEP_GRAPH_TOKENS)."""
        if (self.enforce_eager or not self.resolved_device.startswith("cuda")
                or not self.resolved_pad_eager_steps):
            return 0
        if self.step_graph_tokens is None:
            return DEFAULT_STEP_GRAPH_TOKENS
        return self.step_graph_tokens

    @property
    def resolved_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device.startswith("cuda") else torch.float32
        return _DTYPES[self.dtype]
