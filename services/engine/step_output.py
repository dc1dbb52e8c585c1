"""A launched step: its sampled tokens on the device now, on the host once the device is there.

Rules:
- `tokens` (int64 [S] on the device, one per sampling request, in `request_ids` order) may be
  read by the next step's inputs (a decode's input token) with no host synchronisation.
- Right after sampling, the sampler's outputs are copied to pinned host memory and an event is
  recorded; `result()` waits for that event only, not for work launched after it on the stream
  (which is what lets the host prepare step N+1 while the device runs step N).
- Per-request failures travel with the step: `failed` (request id -> RequestError) from
  sampling, and any raised while turning a request's logprobs into host values; the engine
  finishes those requests with their error. Prompt logprob parts (prompt_logprobs.py) come back
  as host tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from flotilla.services.engine.prompt_logprobs import PromptLogprobsPart
from flotilla.services.engine.request import TokenLogprobs
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampler import SamplerOutput


@dataclass
class RunnerOutput:
    """Per sampling request of the step, in SchedulerOutput order; then per-request extras."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[str, RequestError] = field(default_factory=dict)
    prompt_logprobs: list[PromptLogprobsPart] = field(default_factory=list)


@dataclass
class LaunchedStep:
    request_ids: list[str]  # the sampling requests, in row order
    tokens: torch.Tensor | None  # int64 [S] on the device (None: nothing sampled)
    num_logprobs: list[int | None] = field(default_factory=list)  # each request's `logprobs`
    _host: SamplerOutput | None = None  # pinned host copies of the sampler's outputs
    _event: torch.cuda.Event | None = None
    failed: dict[str, RequestError] = field(default_factory=dict)
    prompt: list[PromptLogprobsPart] = field(default_factory=list)  # host copies once there

    @classmethod
    def start(cls, request_ids: list[str], num_logprobs: list[int | None],
              out: SamplerOutput | None, failed: dict[str, RequestError] | None = None,
              prompt: list[PromptLogprobsPart] | None = None) -> LaunchedStep:
        """Queue the copies of `out` (None: nothing sampled) and `prompt` to the host behind
        the step's work; returns at once."""
        failed, prompt = failed or {}, prompt or []
        if out is None:
            return cls([], None, [], None, None, failed, prompt)
        if out.token_ids.device.type != "cuda":
            return cls(request_ids, out.token_ids, num_logprobs, out, None, failed, prompt)

        def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        host = SamplerOutput(to_host(out.token_ids), to_host(out.logprobs),  # type: ignore[arg-type]
                             to_host(out.top_token_ids), to_host(out.top_logprobs))
        prompt = [part.map(to_host) for part in prompt]  # type: ignore[arg-type]
        event = torch.cuda.Event()
        event.record()
        return cls(request_ids, out.token_ids, num_logprobs, host, event, failed, prompt)

    @classmethod
    def empty(cls) -> LaunchedStep:
        return cls([], None)

    @cached_property
    def rows(self) -> dict[str, int]:
        """Request id -> its row of `tokens`."""
        return {rid: i for i, rid in enumerate(self.request_ids)}

    def result(self) -> RunnerOutput:
        """The sampled tokens (and logprobs) as host values; blocks until they are there."""
        if self._event is not None:
            self._event.synchronize()
        if self._host is None:
            return RunnerOutput([], [], self.failed, self.prompt)
        token_ids = self._host.token_ids.tolist()
        return RunnerOutput(token_ids, self._logprobs(token_ids), self.failed, self.prompt)

    def _logprobs(self, token_ids: list[int]) -> list[TokenLogprobs | None]:
        host = self._host
        assert host is not None
        if host.logprobs is None:
            return [None] * len(token_ids)
        logprobs = host.logprobs.tolist()
        top_ids = host.top_token_ids.tolist() if host.top_token_ids is not None else None
        top_lps = host.top_logprobs.tolist() if host.top_logprobs is not None else None
        result: list[TokenLogprobs | None] = []
        for i, n in enumerate(self.num_logprobs):
            if n is None:
                result.append(None)
                continue
            try:
                top = []
                if n and top_ids is not None and top_lps is not None:
                    top = list(zip(top_ids[i][:n], top_lps[i][:n], strict=True))
                result.append(TokenLogprobs(token_ids[i], logprobs[i], top))
            except Exception as exc:  # noqa: BLE001 - one request's failure ends that request
                self.failed[self.request_ids[i]] = RequestError.of(exc, "gathering logprobs")
                result.append(None)
        return result
