"""Owns the model, its paged KV cache and the sampler; runs one scheduled step at a time.

Rules:
- The runner allocates the KV cache once, in the model dtype (or e4m3 with kv_cache_dtype
  "fp8"), sized as cache_sizing.py says: an explicit block count, an explicit MiB size, or (on
  CUDA) what `gpu_memory_utilization` of the GPU leaves after the weights and a profiling forward
  at the largest batch. If it holds fewer tokens than max_model_len, max_model_len is lowered.
- Hybrid models (linear-attention layers, `model.state_layers()`) also get a state pool
  (state_pool.py, sized in cache_sizing.py before the KV cache). A step zeroes the slots of the
  sequences it starts (num_computed_tokens 0). Their decode steps replay CUDA graphs (padded
  rows index slot -1); their other steps run eagerly (no whole-step graphs). Under tensor
  parallelism each rank holds its heads' share of every slot.
- It knows only the SchedulerOutput (plain data), never the scheduler. For each step it builds the
  flattened inputs (step_inputs.py), runs the model, takes logits only on the last row of every
  sequence that samples, and samples. `launch` returns at once with a LaunchedStep (tokens on the
  device, host copies on their way); `execute` also waits for them (the step's one sync).
- A decode input may be PLACEHOLDER_TOKEN: the token that `prev` (the step launched just before)
  sampled for that request; the runner takes it from prev's device tokens.
- Decode-only steps replay CUDA graphs on CUDA (unless enforce_eager), and so do prefill and
  mixed steps of up to step_graph_tokens bucketed rows (step_graphs.py); everything else is
  eager, on CUDA at bucketed row counts whose GEMMs were warmed at start-up (row_buckets.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from flotilla.kernels import dense_attention
from flotilla.kernels.kv_quant import FP8_KV_DTYPE
from flotilla.services.engine import cache_sizing, prompt_logprobs, step_graphs
from flotilla.services.engine.cache_sizing import dummy_request
from flotilla.services.engine.cpu_decode import CpuDecode
from flotilla.services.engine.cuda_graphs import DecodeGraphs, graph_buckets
from flotilla.services.engine.distributed import tp_min
from flotilla.services.engine.forward_context import forward_context
from flotilla.services.engine.layers.attention import Attention
from flotilla.services.engine.layers.moe_offload import summary as offload_summary
from flotilla.services.engine.loader import load_model
from flotilla.services.engine.prompt_logprobs import PromptLogprobsPart
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.row_buckets import token_buckets, warm_up_gemms
from flotilla.services.engine.sampler import Sampler, SamplingBatch, sample_isolated
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import PLACEHOLDER_TOKEN, ScheduledRequest
from flotilla.services.engine.state_pool import StateCache, state_bytes_per_slot
from flotilla.services.engine.step_graphs import StepGraphs
from flotilla.services.engine.step_inputs import StepInputBuilder, StepInputs
from flotilla.services.engine.step_output import LaunchedStep, RunnerOutput

if TYPE_CHECKING:
    from flotilla.services.engine.config import EngineConfig

log = logging.getLogger(__name__)

__all__ = ["LaunchedStep", "ModelRunner", "RunnerOutput", "StepLogits"]


@dataclass
class StepLogits:
    """A step's forward: the logits of its sampling rows, float32 [S, vocab], and the prompt
    logprobs of its prompt rows (with the requests whose gathering failed)."""

    logits: torch.Tensor
    prompt: list[PromptLogprobsPart] = field(default_factory=list)
    failed: dict[str, RequestError] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.device = torch.device(config.resolved_device)
        self.dtype = config.resolved_dtype
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_tokens = config.max_num_batched_tokens
        self.kernel_selection = config.kernel_selection
        self.model, self.model_config = load_model(model_path, dtype=self.dtype, device=self.device,
                                                   quantization=config.resolved_quantization,
                                                   load_format=config.load_format,
                                                   expert_offload=config.expert_offload,
                                                   kernel_selection=config.kernel_selection)
        if config.expert_offload.active:
            log.info(offload_summary(self.model))
        self.vocab_size = self.model_config.vocab_size
        self.attention = self.model.attention_layers()
        self.kv_fp8 = config.kv_cache_dtype == "fp8"
        if self.kv_fp8:
            _check_fp8_kv_support(self.attention)
        self.sampler = Sampler(config.kernel_selection)
        self.pad_eager_steps = config.resolved_pad_eager_steps
        # the GEMMs at every bucket, run in the KV-cache profile when there is one, else below
        self._gemms_to_warm = self.pad_eager_steps and self.device.type == "cuda"
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.state_layers = self.model.state_layers()
        self.state_cache: StateCache | None = None
        self.num_state_slots = 0
        if self.state_layers:
            self.num_state_slots = cache_sizing.num_state_slots(config, self.state_layers,
                                                                self.dtype, self.device)
            self.state_cache = StateCache(self.state_layers, self.num_state_slots, self.dtype,
                                          self.device)
        self.num_blocks = tp_min(cache_sizing.num_kv_blocks(  # one count for every TP rank
            config, self.device, self.kv_bytes_per_block(), self.state_bytes,
            self._profile_free_memory))
        if self.num_blocks * self.block_size < self.max_model_len:
            log.warning("the KV cache holds %d tokens: max_model_len lowered from %d",
                        self.num_blocks * self.block_size, self.max_model_len)
            self.max_model_len = self.num_blocks * self.block_size
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.inputs = StepInputBuilder(self.max_num_tokens, self.max_num_seqs,
                                       self.max_blocks_per_seq, self.block_size, self.device,
                                       pad=self.pad_eager_steps, states=bool(self.state_layers))
        self.warm_up_dense_attention()
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        # decode-only steps on CPU: the flat-op forward of cpu_decode.py where it applies
        self.cpu_decode = (CpuDecode.build(self.model) if self.device.type == "cpu"
                           and not self.kv_fp8 else None)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self._logits_all_rows, self.max_num_seqs,
                                       self.max_blocks_per_seq, self.max_model_len, self.device,
                                       config.decode_short_context)
            with torch.inference_mode():
                pool = self.graphs.capture()
                self.step_graphs = self._capture_step_graphs(config.resolved_step_graph_tokens,
                                                             pool)
        if self._gemms_to_warm:  # the KV cache size was given: no profile ran
            self._warm_up_gemms()
            torch.cuda.empty_cache()
        if self.device.type == "cuda":
            self.warm_up_eager_steps()

    def release_graphs(self) -> None:
        """Drop every captured graph (before a tensor-parallel communicator goes: graphs
        holding its NCCL kernels block its teardown)."""
        self.graphs = None
        self.step_graphs = None

    def new_step_graphs(self, max_tokens: int) -> StepGraphs | None:
        """Whole-step graphs for the token buckets up to max_tokens (not captured yet), or None
        where this model cannot be captured whole (step_graphs.py `supported`)."""
        buckets = [t for t in token_buckets(self.max_num_tokens) if t <= max_tokens]
        if not buckets or not step_graphs.supported(self.attention) or self.state_layers:
            return None
        return StepGraphs(self._sampled_hidden, buckets, self.max_num_seqs,
                          self.max_blocks_per_seq, self.max_model_len, self.device)

    def _capture_step_graphs(self, max_tokens: int, pool: Any) -> StepGraphs | None:
        graphs = self.new_step_graphs(max_tokens)
        if graphs is not None:
            t0 = time.perf_counter()
            graphs.capture(pool)
            log.info("step graphs captured at %d token buckets (up to %d) in %.1f s",
                     len(graphs.buckets), graphs.buckets[-1], time.perf_counter() - t0)
        return graphs

    def _warm_up_gemms(self) -> None:
        """Every GEMM shape an eager step can run (row_buckets.py), met once now."""
        warm_up_gemms(self.model, self.model_config.hidden_size,
                      token_buckets(self.max_num_tokens), graph_buckets(self.max_num_seqs),
                      self.dtype, self.device)
        self._gemms_to_warm = False

    @torch.inference_mode()
    def warm_up_eager_steps(self) -> None:
        """One eager step per kernel variant an eager step can launch, run now rather than in
        a user's first step of that kind: Triton compiles per tile size, and the prefill
        attention's tile follows the step's longest prompt (16 / 32 / 64 / 128 rows; 0.4-0.8 s
        each on a fresh H100 host). With whole-step graphs no short step runs eagerly at
        start-up otherwise. Single prompts of 16, 32, 128 and 256 tokens, and one long enough
        for the fused long-prompt attention; their K/V land in free blocks, overwritten before
        any sequence reads them."""
        lengths = [n for n in (16, 32, 128, 256, 2 * dense_attention.DENSE_MIN_TOKENS)
                   if n <= min(self.max_num_tokens, self.max_model_len)]
        for n in lengths:
            blocks = list(range(-(-n // self.block_size)))
            if len(blocks) > self.num_blocks:
                break
            inputs = self._build_inputs([dummy_request("warm-up", n, blocks)])
            with forward_context(inputs.meta):
                hidden = self.model(inputs.input_ids, inputs.positions)
            self.model.compute_logits(hidden[inputs.logits_rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up_dense_attention(self) -> None:
        """Fused-attention plans for every long-prompt length bucket (kernels/dense_attention.py),
        built now rather than on a user's first long prompt; PyTorch keeps them per thread, so a
        server calls this again on the thread that steps the engine (services/engine/loop.py).
        Does nothing on CPU or where the selection's dense_prefill (FLOTILLA_DENSE_PREFILL)
        turns the path off."""
        layer = next((a for a in self.attention if type(a) is Attention), None)
        if layer is not None and self.device.type == "cuda":
            dense_attention.warm_up(layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                    self.dtype, self.device, self.max_num_tokens,
                                    self.kernel_selection.dense_prefill)

    # ------------------------------------------------------------------ KV cache

    @property
    def kv_dtype(self) -> torch.dtype:
        return FP8_KV_DTYPE if self.kv_fp8 else self.dtype

    def kv_bytes_per_block(self) -> int:
        return cache_sizing.kv_bytes_per_block(self.attention, self.kv_dtype, self.block_size,
                                               self.kv_fp8)

    @property
    def state_bytes(self) -> int:
        """Bytes of the state pool (0 without linear-attention layers)."""
        return self.num_state_slots * state_bytes_per_slot(self.state_layers, self.dtype)

    def _allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        return cache_sizing.allocate_kv_cache(self.attention, num_blocks, self.block_size,
                                              self.kv_dtype, self.kv_fp8, self.device)

    @torch.inference_mode()
    def _profile_free_memory(self, utilization: float) -> int:
        """Bytes left for the KV cache after a forward + sampling at the largest step."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        requests, num_blocks, blocks_per_seq = cache_sizing.profile_requests(
            self.max_num_tokens, self.max_model_len, self.max_num_seqs, self.block_size,
            self.num_state_slots)
        self.kv_cache = self._allocate_kv_cache(num_blocks)
        builder = StepInputBuilder(self.max_num_tokens, len(requests), blocks_per_seq,
                                   self.block_size, self.device, states=bool(self.state_layers))
        inputs = builder.build(requests)
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        rows = torch.arange(self.max_num_seqs, device=self.device) % hidden.shape[0]
        logits = self.model.compute_logits(hidden[rows])
        # The sampler's most memory-hungry path: full sort (top-p without top-k) + penalties.
        params = [SamplingParams(top_p=0.9, min_p=0.05, repetition_penalty=1.1, logprobs=5)]
        batch = SamplingBatch.build(params * logits.shape[0], [None] * logits.shape[0],
                                    [[0]] * logits.shape[0], [1] * logits.shape[0],
                                    self.vocab_size, self.device)
        self.sampler(logits, batch)
        torch.cuda.synchronize()
        del hidden, logits, inputs, builder
        cache_sizing.unbind_kv_cache(self.attention, self.device)  # drop the profiling cache
        self.kv_cache = []
        if self._gemms_to_warm:  # its activations count in the peak too
            self._warm_up_gemms()
        return cache_sizing.budget_after_peak(self.device, utilization)

    # ------------------------------------------------------------------ steps

    def _build_inputs(self, requests: list[ScheduledRequest]) -> StepInputs:
        """The step's inputs; the state slots of the sequences it starts are zeroed first."""
        if self.state_cache is not None:
            self.state_cache.reset([r.state_slot for r in requests if r.num_computed_tokens == 0])
        return self.inputs.build(requests)

    def _logits_all_rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions))

    def _sampled_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)[rows]

    def _logits(self, input_ids: torch.Tensor, inputs: StepInputs, decode_only: bool
                ) -> torch.Tensor:
        """Logits of the sampling rows of the step, [S, vocab] float32."""
        if decode_only and self.graphs is not None:
            # Every row of a decode-only step samples, in order: no row gather needed.
            return self.graphs.replay(input_ids, inputs.positions, inputs.meta)
        if decode_only and self.cpu_decode is not None:
            return self.cpu_decode.logits(input_ids, inputs.positions, inputs.meta)[
                : inputs.num_logits]
        if self.step_graphs is not None and self.step_graphs.covers(inputs):
            hidden = self.step_graphs.replay(input_ids, inputs)
            return self.model.compute_logits(hidden)[: inputs.num_logits]
        with forward_context(inputs.meta):
            hidden = self.model(input_ids, inputs.positions)
        return self.model.compute_logits(hidden[inputs.logits_rows])[: inputs.num_logits]

    def _input_ids(self, inputs: StepInputs, requests: list[ScheduledRequest],
                   prev: LaunchedStep | None) -> torch.Tensor:
        """The step's token ids, each PLACEHOLDER_TOKEN replaced by prev's device token."""
        waiting = [i for i, r in enumerate(requests) if r.token_ids[-1] == PLACEHOLDER_TOKEN]
        if not waiting:
            return inputs.input_ids
        if prev is None or prev.tokens is None:
            raise RuntimeError("a placeholder token without the step that samples it")
        if (len(waiting) == len(requests) == len(prev.request_ids) == inputs.num_tokens
                and all(r.request_id == rid for r, rid in zip(requests, prev.request_ids,
                                                              strict=True))):
            return prev.tokens  # steady decode: the same requests in the same order
        qsl = inputs.meta.query_start_loc_cpu
        dst = torch.tensor([qsl[i + 1] - 1 for i in waiting]).to(self.device, non_blocking=True)
        src = torch.tensor([prev.rows[requests[i].request_id] for i in waiting])
        ids = inputs.input_ids
        ids[dst] = prev.tokens[src.to(self.device, non_blocking=True)]
        return ids

    @torch.inference_mode()
    def execute(self, requests: list[ScheduledRequest], decode_only: bool) -> RunnerOutput:
        """Run one step and wait for its tokens."""
        return self.launch(requests, decode_only).result()

    @torch.inference_mode()
    def forward_step(self, requests: list[ScheduledRequest], decode_only: bool,
                     prev: LaunchedStep | None = None, gather: bool = False) -> StepLogits:
        """The step's forward up to the logits of its sampling rows, without sampling (what a
        tensor-parallel worker runs; `launch` samples them), and the prompt logprobs of its
        prompt rows (prompt_logprobs.py; gathered only with `gather`, on rank 0). A step with
        prompt rows runs eagerly: graphs keep only the sampled rows' hidden states."""
        inputs = self._build_inputs(requests)
        input_ids = self._input_ids(inputs, requests, prev)
        if decode_only or not any(r.prompt_logprob_rows for r in requests):
            return StepLogits(self._logits(input_ids, inputs, decode_only))
        with forward_context(inputs.meta):
            hidden = self.model(input_ids, inputs.positions)
        logits = self.model.compute_logits(hidden[inputs.logits_rows])[: inputs.num_logits]
        failed: dict[str, RequestError] = {}
        parts = prompt_logprobs.compute(self.model.compute_logits, hidden,
                                        inputs.meta.query_start_loc_cpu, requests, gather,
                                        failed)
        return StepLogits(logits, parts, failed)

    @torch.inference_mode()
    def launch(self, requests: list[ScheduledRequest], decode_only: bool,
               prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on the device; its tokens come from the returned LaunchedStep. A
        request whose sampling fails is reported in the step's `failed`; the others sample."""
        step = self.forward_step(requests, decode_only, prev, gather=True)
        sampling = [r for r in requests if r.samples]
        if not sampling:
            return LaunchedStep.start([], [], None, step.failed, step.prompt)
        out = sample_isolated(self.sampler, step.logits, sampling, self.vocab_size)
        failed = step.failed
        failed.update({sampling[row].request_id: err for row, err in out.failed.items()})
        return LaunchedStep.start([r.request_id for r in sampling],
                                  [r.sampling_params.logprobs for r in sampling], out, failed,
                                  step.prompt)

    @torch.inference_mode()
    def all_logits(self, request: ScheduledRequest) -> torch.Tensor:
        """Logits of every new token of one sequence (eager), float32 [n, vocab] on the host."""
        inputs = self._build_inputs([request])
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        return self.model.compute_logits(hidden[: inputs.num_tokens]).float().cpu()

    @torch.inference_mode()
    def pool_hidden(self, requests: list[ScheduledRequest]) -> torch.Tensor:
        """Final-normed hidden states of every new token of the requests (eager), [n, hidden]
        on the device: what pooling requests (embeddings) reduce to one vector each."""
        inputs = self._build_inputs(requests)
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        return hidden[: inputs.num_tokens]


def _check_fp8_kv_support(layers: list[Attention]) -> None:
    unsupported = sorted({type(a).__name__ for a in layers if not a.supports_fp8_kv_cache})
    if unsupported:
        raise ValueError(f"the fp8 KV cache (--fp8-kvcache, FLOTILLA_KV_CACHE_DTYPE=fp8) is not "
                         f"supported by this model's attention ({', '.join(unsupported)}: MLA "
                         "keeps its latent cache in the model dtype); run without it")
