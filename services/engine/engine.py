"""The engine core: requests in, tokens out, one `step()` at a time.

Rules:
- `step()` reads as schedule -> run -> postprocess. It returns one RequestOutput per request that
  produced a token or finished in that step (aborts included).
- Async scheduling (default on CUDA): `step()` launches step N, then waits for step N-1's tokens
  and postprocesses them, so the host's scheduling and input building overlap the device's work.
  Step N is scheduled before step N-1's tokens are known: each such token is PLACEHOLDER_TOKEN
  in request.token_ids until it arrives, and the device feeds it to step N directly. Outputs
  thus come one `step()` later. Requests whose sampling reads their generated tokens on the host
  (penalties, grammars) make that step wait first. A request found finished when its token
  arrives wastes at most the one step already launched for it.
- Single-threaded: add_request / abort / step / prompt_logits are called from one thread, between
  steps. `abort` frees the request's KV blocks at once; its final output comes with the next step.
- A request finishes with 'stop' on an eos token (unless ignore_eos) or one of its stop ids
  (not before min_tokens), 'length' at max_tokens or at the context length (max_model_len),
  'abort' when aborted, 'error' when it failed on its own (its RequestOutput carries the
  RequestError): its sampling, logit processors, grammar or logprobs raised (the executor
  reports them per request), or its deadline passed (checked at the start of every step). The
  other requests of the batch go on unchanged; only a failing forward raises from `step()`.
- `add_request` checks what the engine itself relies on (token ids inside the vocabulary, room
  in the context: libs/common/context.py, max_tokens None = the room left, more = refused) and
  raises ValueError; the service checks the rest before (admission.py).
- Priority (lower first) and arrival order decide which waiting request is admitted next
  (waiting_queue.py).
- With prompt_logprobs, the request's first output carries them (one entry per prompt token,
  the first None).
- Pooling requests (`add_request` with PoolingParams: embeddings, score, rerank) wait in their
  own queue (pooling.py); every step runs one pooling batch before its generation step, and a
  finished one comes out as a RequestOutput whose `pooled` holds its vector (finish 'stop').
- Hybrid models (linear attention, the runner's state pool): each running request holds a state
  slot (the scheduler hands them out); prefix caching is off for them (a cached prefix would
  skip tokens whose recurrent state is not kept), and pooling is not offered.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from flotilla.libs.common.context import resolve_max_tokens
from flotilla.libs.common.model_cache import resolve_model
from flotilla.services.engine import prompt_logprobs
from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.deadlines import Deadlines, deadline_error
from flotilla.services.engine.executor import make_executor
from flotilla.services.engine.kv_cache_manager import KVCacheManager
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.pooling import PoolingJob, PoolingParams, PoolingQueue
from flotilla.services.engine.pooling_config import model_pooling
from flotilla.services.engine.postprocess import InFlight, add_placeholders, write_tokens
from flotilla.services.engine.request import Request, RequestStatus
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.request_output import RequestOutput, request_output
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import (
    PLACEHOLDER_TOKEN,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from flotilla.services.engine.state_pool import StateSlots

log = logging.getLogger(__name__)


@dataclass
class _Counters:
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    tokens_generated: int = 0
    steps: int = 0
    pooled: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.seed is not None:
            torch.manual_seed(config.seed)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model)
        self.executor = make_executor(config, str(path))
        self.runner = self.executor.runner  # rank 0's
        self.model_config: ModelConfig = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        if config.prefill_chunk_size == 0 and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        hybrid = self.runner.num_state_slots > 0
        if hybrid and config.enable_prefix_caching:
            log.info("prefix caching is off: %s is a hybrid (linear-attention) model whose "
                     "per-sequence state is not kept per block", self.model_config.architecture)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching and not hybrid)
        self.state_slots = StateSlots(self.runner.num_state_slots) if hybrid else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            config.prefill_chunk_size),
            self.kv, self.state_slots,
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.pooling = PoolingQueue()
        self.model_pooling = model_pooling(path, self.model_config.hf_config,
                                           self.model_config.hidden_size, config.pooling)
        self._pending: list[RequestOutput] = []  # abort / error outputs, for the next step
        self.deadlines = Deadlines()
        self._inflight: InFlight | None = None
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self._counts = _Counters()
        # the latest step's plan and its phases (s): up to the launch (scheduling, or collecting
        # the previous step first when it cannot overlap), the launch, collecting after it
        self.last_scheduled: SchedulerOutput | None = None
        self.last_phases: tuple[float, ...] = (0.0, 0.0, 0.0)
        log.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d%s",
                 path, self.runner.device, self.runner.dtype, self.runner.num_blocks,
                 config.block_size, self.max_model_len,
                 f", {self.runner.num_state_slots} linear-attention state slots" if hybrid
                 else "")

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams | None = None, priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Queue a request; `priority` lower first, `deadline` Unix time (see module rules)."""
        if isinstance(params, PoolingParams):
            self._add_pooling(request_id, prompt_token_ids, params, priority, deadline)
            return
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        max_tokens = resolve_max_tokens(n, params.max_tokens, self.max_model_len)
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens "
                             "this request may generate")
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        request = Request(request_id, list(prompt_token_ids), params, max_tokens,
                          self.eos_token_ids, generator, priority, deadline)
        self.scheduler.add_request(request)
        if deadline is not None:
            self.deadlines.add(request_id, deadline)
        self._counts.prompt_tokens += n

    def _add_pooling(self, request_id: str, token_ids: list[int], params: PoolingParams,
                     priority: int, deadline: float | None) -> None:
        if self.state_slots is not None:
            raise ValueError("pooling (embeddings, score, rerank) is not supported for hybrid "
                             "(linear-attention) models")
        if not self.executor.supports_pooling:
            raise ValueError("pooling (embeddings, score, rerank) is not supported with tensor "
                             "parallelism yet")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id} is already running")
        job = PoolingJob(request_id, list(token_ids), params, priority, deadline)
        self.pooling.add(job, self.max_model_len, self.vocab_size)
        if deadline is not None:
            self.deadlines.add(request_id, deadline)
        self._counts.prompt_tokens += job.num_tokens

    def _finish_pooling(self, request_id: str, status: RequestStatus,
                        error: RequestError | None = None) -> bool:
        job = self.pooling.remove(request_id, self.kv)
        if job is None:
            return False
        job.request.status, job.request.error = status, error
        self._pending.append(request_output(job.request, []))
        return True

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; False if it is unknown or already done."""
        if self._finish_pooling(request_id, RequestStatus.FINISHED_ABORTED):
            self._counts.aborted += 1
            return True
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return False
        self._counts.aborted += 1
        while request.token_ids[-1] == PLACEHOLDER_TOKEN:  # tokens still on their way
            request.token_ids.pop()
        self._pending.append(request_output(request, []))
        return True

    def fail(self, request_id: str, error: RequestError) -> bool:
        """Finish a request with an error now (blocks freed; its output, carrying the error,
        comes with the next step); False if it is unknown or already done."""
        if self._finish_pooling(request_id, RequestStatus.FINISHED_ERROR, error):
            self._counts.failed += 1
            return True
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        if request is None:
            return False
        self._counts.failed += 1
        request.error = error
        while request.token_ids[-1] == PLACEHOLDER_TOKEN:
            request.token_ids.pop()
        self._pending.append(request_output(request, []))
        log.info("request %s failed: %s", request_id, error.message)
        return True

    def expire_deadlines(self, now: float | None = None) -> None:
        """Fail every request whose deadline has passed (504); their outputs come with the
        next step. One comparison when none is due."""
        next_deadline = self.deadlines.next()
        if next_deadline is None:
            return
        now = time.time() if now is None else now
        if next_deadline > now:
            return
        for request_id in self.deadlines.due(now):
            request = self.scheduler.requests.get(request_id)
            if request is None and request_id in self.pooling.jobs:
                request = self.pooling.jobs[request_id].request
            if request is not None:
                self.fail(request_id, deadline_error(request, now))

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending)
                or self._inflight is not None or bool(self.pooling))

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.expire_deadlines()
        outputs, self._pending = self._pending, []
        if self.pooling:  # the runner's buffers must be free: no step in flight
            if self._inflight is not None:
                outputs.extend(self._postprocess())
            outputs.extend(self._pool_step())
        elif self._inflight is not None and not self._can_overlap():
            outputs.extend(self._postprocess())
        scheduled = self.last_scheduled = self.scheduler.schedule()
        inflight = None
        t1 = time.perf_counter()
        if not scheduled.is_empty:
            prev = self._inflight.launched if self._inflight is not None else None
            decode_only = scheduled.is_decode_only and not scheduled.has_prompt_logprobs
            launched = self.executor.launch(scheduled.requests, decode_only, prev)
            inflight = InFlight(launched, self._add_placeholders(scheduled.requests))
            self._counts.steps += 1
        t2 = time.perf_counter()
        if self._inflight is not None:  # the device now runs `launched`: collect the step before
            outputs.extend(self._postprocess())
        self._inflight = inflight
        if inflight is not None and not self.async_scheduling:
            outputs.extend(self._postprocess())
        self.last_phases = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return outputs

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the in-flight step's tokens are known:
        not if a running request's sampling reads its generated tokens on the host (penalties,
        a grammar's bitmask)."""
        return self.async_scheduling and not any(
            r.samples_from_host_tokens for r in self.scheduler.running)

    def _add_placeholders(self, requests: list[ScheduledRequest]) -> list[tuple[Request, int]]:
        return add_placeholders(self.scheduler, requests)

    def _postprocess(self) -> list[RequestOutput]:
        """Wait for the in-flight step's tokens and write them over their placeholders
        (postprocess.py); the outputs of the requests that failed in it come first."""
        assert self._inflight is not None
        inflight, self._inflight = self._inflight, None
        result = inflight.launched.result()
        live = self.scheduler.requests
        if result.prompt_logprobs:
            for part in result.prompt_logprobs:
                if (request := live.get(part.request_id)) is not None:
                    prompt_logprobs.store(request, part)
        if result.failed:
            for request_id, error in result.failed.items():
                self.fail(request_id, error)
            self._pending, outputs = [], self._pending
        else:
            outputs = []
        written = write_tokens(self.scheduler, inflight, result)
        self._counts.finished += written.finished
        self._counts.tokens_generated += written.generated
        return outputs + written.outputs

    def _pool_step(self) -> list[RequestOutput]:
        """One pooling batch (pooling.py); the outputs of the jobs it finished."""
        outputs = []
        for job, vector in self.pooling.run_batch(self.kv, self.executor.pool_hidden,
                                                  self._lm_head, self.config.max_num_batched_tokens,
                                                  self.config.max_num_seqs):
            job.request.status = RequestStatus.FINISHED_STOPPED
            out = request_output(job.request, [], num_output_tokens=0)
            out.stop_token_id, out.pooled = None, vector  # nothing was generated
            outputs.append(out)
        self._counts.pooled += len(outputs)
        return outputs

    @torch.inference_mode()
    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final-normed hidden rows (a reranker's yes / no, pooling.py)."""
        return self.runner.model.compute_logits(hidden.to(self.runner.dtype))

    # ------------------------------------------------------------------ extras

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every prompt position, float32 [T, vocab] on the host (runs between steps)."""
        if self._inflight is not None:  # the runner's buffers must be free; keep its outputs
            self._pending.extend(self._postprocess())
        n = len(token_ids)
        if not 0 < n <= self.max_model_len:
            raise ValueError(f"prompt_logits needs 1..{self.max_model_len} tokens, got {n}")
        request = Request("__prompt_logits__", list(token_ids), SamplingParams(), 1)
        chunk = self.config.max_num_batched_tokens
        parts = []
        if self.state_slots is not None and not self.state_slots.allocate(request):
            raise RuntimeError("prompt_logits: no linear-attention state slot is free")
        try:
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                if not self.kv.allocate_slots(request, end - start):
                    raise RuntimeError("prompt_logits: the KV cache has no room for this prompt")
                parts.append(self.executor.all_logits(ScheduledRequest(
                    request_id=request.request_id, token_ids=request.token_ids[start:end],
                    num_computed_tokens=start, block_ids=request.block_ids, is_prefill=True,
                    samples=False, sampling_params=request.sampling_params, generator=None,
                    prompt_len=n, all_token_ids=request.token_ids,
                    state_slot=request.state_slot,
                )))
                request.num_computed_tokens = end
        finally:
            self.kv.free(request)
            if self.state_slots is not None:
                self.state_slots.free(request)
        return torch.cat(parts)

    def prepare_thread(self) -> None:
        """Build the per-thread caches (cuDNN attention plans) on the thread that will call
        `step()` (PyTorch keeps them per thread; loop.py calls this from its thread)."""
        self.runner.warm_up_dense_attention()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine is unusable afterwards."""
        self.executor.shutdown()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        pool = self.kv.pool
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "waiting_tokens": self.scheduler.waiting.num_tokens,
            "finished": self._counts.finished,
            "aborted": self._counts.aborted,
            "failed": self._counts.failed,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_cached": pool.num_cached_blocks,
            "prompt_tokens": self._counts.prompt_tokens,
            "cached_prompt_tokens": self.scheduler.prefix_hit_tokens,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prefix_cache_query_tokens": self.scheduler.prefix_query_tokens,
            "tokens_generated": self._counts.tokens_generated,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self._counts.steps,
            "pooling": len(self.pooling),
            "pooling_tokens": self.pooling.num_tokens,
            "pooled": self._counts.pooled,
        }

