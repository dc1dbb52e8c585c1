"""The engine's pooling subject (`engine_pool(model)`): PoolRequest in, PoolReply out.

Rules:
- Admission answers at once, in the reply, what it can: an empty input, a token id outside the
  vocabulary or an input longer than the context is a 400 naming `input`; `dimensions` the
  model cannot honour a 400 naming it (pooling_config.py); a passed deadline a 504; an executor
  without pooling (tensor-parallel pods) a 400. Pooling has its own queue bound, the same
  numbers as generation's (admission.py) counted over pooling requests in flight and their
  tokens: past it a 503 with retry_after_s (a lone request always passes). Generation's queue
  does not count pooling work, so a large embeddings batch never makes chat requests 503, nor
  the reverse.
- Each input becomes one engine pooling job `<request id>.<index>`; the reply waits for all of
  them. A job's error (its deadline, a failed engine) fails the whole reply with that error;
  a Cancel for the request aborts every job still running and answers at once.
- Vectors go back as base64 of little-endian float32 (PoolReply).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from flotilla.libs.common.errors import FlotillaError, invalid_request
from flotilla.libs.common.pooling_messages import PoolReply, PoolRequest
from flotilla.services.engine.admission import QueueLimits, check_deadline
from flotilla.services.engine.engine import RequestOutput
from flotilla.services.engine.executor import Executor
from flotilla.services.engine.loop import EngineLoop
from flotilla.services.engine.pooling import PoolingParams
from flotilla.services.engine.pooling_config import ModelPooling
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.wire import error_info


class PoolingEngine(Protocol):
    """What pooling admission reads from an engine (`Engine`, engine.py, is one): whether its
    executor can pool, the checkpoint's pooling, the vocabulary and the context length."""

    @property
    def executor(self) -> Executor: ...

    @property
    def model_pooling(self) -> ModelPooling: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...


def encode_vector(vector: torch.Tensor) -> str:
    """A float32 vector as OpenAI's base64 embedding (little-endian float32 bytes)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


class PoolService:
    """Pooling requests of one engine service; `on_output` takes the engine's outputs first."""

    def __init__(
        self,
        engine: PoolingEngine,
        loop: EngineLoop,
        limits: QueueLimits,
        crashed: Callable[[], BaseException | None],
    ) -> None:
        self.engine, self.loop, self.limits, self._crashed = engine, loop, limits, crashed
        self._jobs: dict[str, asyncio.Future[RequestOutput]] = {}  # job id -> its output
        self._groups: dict[str, list[str]] = {}  # request id -> its job ids
        self._tokens: dict[str, int] = {}  # request id -> its tokens (the queue bound)

    def _check(self, req: PoolRequest) -> PoolingParams:
        engine = self.engine
        if not engine.executor.supports_pooling:
            raise invalid_request(
                "embeddings, score and rerank are not supported by a tensor-parallel engine yet",
                param="model",
            )
        reason = engine.model_pooling.check_dimensions(req.pooling.dimensions)
        if reason is not None:
            raise invalid_request(reason, param="dimensions", code="invalid_value")
        vocab, limit = engine.vocab_size, engine.max_model_len
        logit_ids = req.pooling.logit_ids
        if logit_ids is not None and not all(0 <= i < vocab for i in logit_ids):
            raise invalid_request(f"logit ids must be in [0, {vocab})", param="logit_ids")
        for i, ids in enumerate(req.prompts):
            if not ids:
                raise invalid_request(f"input {i} is empty", param="input")
            if min(ids) < 0 or max(ids) >= vocab:
                raise invalid_request(
                    f"input {i} holds a token id outside [0, {vocab})",
                    param="input",
                    code="invalid_value",
                )
            if len(ids) > limit:
                raise invalid_request(
                    f"This model's maximum context length is {limit} tokens. However, input {i} "
                    f"has {len(ids)} tokens.",
                    param="input",
                    code="context_length_exceeded",
                )
        if req.request_id in self._groups:
            raise invalid_request(
                f"request id {req.request_id} is already running", param="request_id"
            )
        if logit_ids is not None:  # a reranker's answer: the last token's logits
            return PoolingParams("last", False, None, tuple(logit_ids))
        return PoolingParams(
            req.pooling.method or engine.model_pooling.method,
            req.pooling.normalize,
            req.pooling.dimensions,
        )

    async def handle(self, req: PoolRequest) -> PoolReply:
        crashed = self._crashed()
        if crashed is not None:
            return PoolReply(
                error=error_info(
                    RequestError(
                        f"the engine failed: {crashed}", 503, "service_unavailable", "engine_failed"
                    )
                )
            )
        try:
            params = self._check(req)
        except FlotillaError as exc:
            return PoolReply(error=exc.info)
        tokens = sum(len(p) for p in req.prompts)
        refusal = check_deadline(req.deadline)
        if refusal is None:
            refusal = self.limits.check(
                len(self._groups),
                sum(self._tokens.values()),
                tokens,
                self.loop.queue_state().tokens_per_s,
            )
        if refusal is not None:
            return PoolReply(error=error_info(refusal))
        running = asyncio.get_running_loop()
        ids = [f"{req.request_id}.{i}" for i in range(len(req.prompts))]
        self._groups[req.request_id] = ids
        self._tokens[req.request_id] = tokens
        futures = []
        for job_id, prompt in zip(ids, req.prompts, strict=True):
            self._jobs[job_id] = future = running.create_future()
            futures.append(future)
            self.loop.add(job_id, prompt, params, req.priority, req.deadline)
        try:
            outputs = await asyncio.gather(*futures, return_exceptions=True)
        finally:
            self.cancel(req.request_id)  # jobs still running after one failed
            self._tokens.pop(req.request_id, None)
            for job_id in ids:
                self._jobs.pop(job_id, None)
        vectors = []
        for out in outputs:
            if isinstance(out, BaseException):
                return PoolReply(error=error_info(RequestError.of(out, "pooling")))
            assert out.pooled is not None  # on_output delivers only pooled outputs
            vectors.append(encode_vector(out.pooled))
        return PoolReply(embeddings=vectors, prompt_tokens=sum(len(p) for p in req.prompts))

    @property
    def pending(self) -> int:
        """Pooling requests admitted and not answered yet (a drain waits for them)."""
        return len(self._groups)

    def on_output(self, out: RequestOutput) -> bool:
        """Deliver a pooling job's output; False if `out` is not one (generation's)."""
        future = self._jobs.get(out.request_id)
        if future is None:
            return False
        if not future.done():
            if out.error is not None:
                future.set_exception(out.error)
            elif out.pooled is None:
                future.set_exception(
                    RequestError("the request was aborted", 503, "service_unavailable", "aborted")
                )
            else:
                future.set_result(out)
        return True

    def cancel(self, request_id: str) -> bool:
        """Abort every running job of a request (a Cancel); False if it has none."""
        ids = self._groups.pop(request_id, None)
        if ids is None:
            return False
        for job_id in ids:
            future = self._jobs.get(job_id)
            if future is not None and not future.done():
                self.loop.abort(job_id)
                # answered now: a job still held by the loop's admission window has no output
                future.set_exception(
                    RequestError(
                        "the request was cancelled", 503, "service_unavailable", "cancelled"
                    )
                )
        return True

    def fail_all(self, error: RequestError) -> None:
        """The engine broke: every waiting reply gets `error`."""
        for future in self._jobs.values():
            if not future.done():
                future.set_exception(error)
