"""The library API: an Engine in-process, no NATS.

    llm = LLM("default")                       # or a path / hub id; engine options as keywords
    llm.generate(["Hello"], SamplingParams(max_tokens=32))
    async for out in llm.stream(prompt_ids, params): ...
    llm.prompt_logits(token_ids)               # [T, vocab] float32

Rules:
- The engine options are the server's: the EngineConfig the engine service derives from its
  settings' defaults (factory.engine_config over EngineSettings' defaults; the FLOTILLA_*
  environment is not read here), so quantization ("auto": on CPU the int8 / int4 weights the
  server keeps), threads (torch's default, as the server's `num_threads` unset), the kernels
  and the step budget are the same, and the library and `flotilla up` generate alike. Keyword
  arguments override single fields, the kernel choices included
  (`kernel_selection=KernelSelection(...)`, kernels/selection.py: each LLM keeps its own).
  Like the service, the engine is built on the thread that steps it (the caller's; one OpenMP
  pool on CPU: loop.py). bench/library_decode.py compares the two decode speeds.
- Prompts are token-id lists, or strings when the tokenizer service's core
  (`Tokenizer.from_path`) can read the model's tokenizer; outputs then carry decoded text.
- `generate` drives the engine to completion synchronously; it must not overlap with streams.
- Streams share one engine loop task on the running event loop. Each step runs on the loop's
  thread (the engine is single-threaded), so other coroutines wait while a step computes.
  Leaving a stream early aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from flotilla.libs.common.model_cache import resolve_model
from flotilla.libs.common.settings import EngineSettings
from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.engine import Engine, RequestOutput
from flotilla.services.engine.request import TokenLogprobs
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    text: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token (the first None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: RequestError | None = None  # why it finished with "error" (it failed alone)


class LLM:
    def __init__(self, model: str = "default", tokenizer: str | None = None,
                 **engine_kwargs: Any) -> None:
        """`engine_kwargs`: EngineConfig's fields, over the engine service's defaults (see the
        module rules; quantization=None loads the checkpoint's own floats)."""
        path = resolve_model(model)
        self.engine = Engine(server_config(path, **engine_kwargs))
        self.tokenizer = load_tokenizer(Path(tokenizer) if tokenizer else path)
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None

    # ------------------------------------------------------------------ prompts

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer available: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _decode(self, token_ids: list[int]) -> str | None:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else None

    # ------------------------------------------------------------------ sync

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        if self._queues:
            raise RuntimeError("generate() cannot run while streams are open")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [self._token_ids(prompts)]  # type: ignore[arg-type]
        else:
            batch = [self._token_ids(p) for p in prompts]  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        rids = [f"gen-{next(self._ids)}" for _ in batch]
        results = {rid: Completion(rid, ids, [], None, 0)
                   for rid, ids in zip(rids, batch, strict=True)}
        for rid, ids, p in zip(rids, batch, params, strict=True):
            self.engine.add_request(rid, ids, p)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results.get(out.request_id)
                if res is None:  # e.g. the abort of a stream left early
                    continue
                res.token_ids.extend(out.new_token_ids)
                res.num_cached_tokens = out.num_cached_tokens
                if out.logprobs:
                    res.logprobs = (res.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    res.finish_reason, res.error = out.finish_reason, out.error
        for res in results.values():
            res.text = self._decode(res.token_ids)
        return [results[rid] for rid in rids]

    def prompt_logits(self, token_ids: Prompt) -> torch.Tensor:
        """Logits at every prompt position, float32 [T, vocab] (position t predicts t + 1)."""
        return self.engine.prompt_logits(self._token_ids(token_ids))

    # ------------------------------------------------------------------ async

    async def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield each step's RequestOutput for one prompt until it finishes."""
        rid = f"stream-{next(self._ids)}"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.engine.add_request(rid, self._token_ids(prompt), sampling_params)
        self._queues[rid] = queue
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.engine.abort(rid)
            if self._wakeup is not None:
                self._wakeup.set()  # lets the loop task notice it may exit

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._run())
        assert self._wakeup is not None
        self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self.engine.has_unfinished():
                if not self._queues:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken engine fails every open stream, never hangs
                for queue in self._queues.values():
                    queue.put_nowait(exc)
                raise
            for out in outputs:
                if (target := self._queues.get(out.request_id)) is not None:
                    target.put_nowait(out)
            await asyncio.sleep(0)


def server_config(path: Path, **overrides: Any) -> EngineConfig:
    """The EngineConfig the engine service builds for `path` from its settings' defaults,
    with `overrides` (EngineConfig's fields) applied."""
    from flotilla.services.engine.factory import engine_config  # it imports engine.py, as this does

    return dataclasses.replace(engine_config(EngineSettings.model_construct(), path), **overrides)


def load_tokenizer(path: Path) -> TextTokenizer | None:
    """The tokenizer service's core for the model at path; None if it cannot build one."""
    try:
        from flotilla.services.tokenizer import Tokenizer

        return Tokenizer.from_path(path)
    except Exception:  # noqa: BLE001 - without a tokenizer the LLM still works on token ids
        return None
