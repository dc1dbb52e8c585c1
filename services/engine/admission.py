"""What the engine service checks before it takes a request: its sampling options against the
engine's real ranges, its deadline, and room in the engine's bounded queue.

Rules:
- `to_sampling_params` maps the bus's SamplingOptions onto SamplingParams, which checks every
  value (sampling_params.py), plus what needs the model: max_tokens resolved by the context
  rule (libs/common/context.py: absent = the room left, too large = ContextLengthExceeded),
  token ids inside the vocabulary. A bad value raises InvalidParameter or
  ContextLengthExceeded (a 400 naming it); nothing that passes can raise inside a step.
- The queue is bounded (`QueueLimits`): at most `max_waiting_requests` requests and
  `max_waiting_tokens` prompt tokens wait for their first step (in the engine's waiting queue
  or on their way to it). Past either, a request is refused with 503, code "engine_overloaded",
  and a retry_after_s of the queue's expected drain time (its tokens over the engine's recent
  token rate), clamped to [1, 30] s. A request is never refused for its own size while nothing
  waits: a long prompt alone is admitted.
- A deadline already past is refused with 504, code "deadline_exceeded".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flotilla.libs.common.context import resolve_max_tokens
from flotilla.libs.common.messages import SamplingOptions
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampling_params import SamplingParams

RETRY_AFTER_S = (1.0, 30.0)


def to_sampling_params(opts: SamplingOptions, prompt_len: int, max_model_len: int,
                       vocab_size: int) -> SamplingParams:
    """The engine's params for a request (its grammar, if any, is compiled separately)."""
    max_tokens = resolve_max_tokens(prompt_len, opts.max_tokens, max_model_len)
    params = SamplingParams(
        temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p,
        seed=opts.seed, max_tokens=max_tokens, stop_token_ids=list(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos, presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty, repetition_penalty=opts.repetition_penalty,
        logprobs=opts.logprobs, logit_bias=dict(opts.logit_bias), min_tokens=opts.min_tokens,
        prompt_logprobs=opts.prompt_logprobs,
    )
    params.check_vocab(vocab_size)
    return params


def retry_after_s(waiting_tokens: int, tokens_per_s: float) -> float:
    """Expected time for the queue to drain, clamped to RETRY_AFTER_S."""
    low, high = RETRY_AFTER_S
    if tokens_per_s <= 0:
        return high
    return round(min(max(waiting_tokens / tokens_per_s, low), high), 1)


@dataclass
class QueueLimits:
    max_waiting_requests: int
    max_waiting_tokens: int

    def check(self, waiting: int, waiting_tokens: int, prompt_tokens: int,
              tokens_per_s: float) -> RequestError | None:
        """None if a request of `prompt_tokens` may join a queue of `waiting` requests holding
        `waiting_tokens`; else the 503 to answer (see module rules)."""
        if waiting == 0:
            return None
        if waiting < self.max_waiting_requests and (
                waiting_tokens + prompt_tokens <= self.max_waiting_tokens):
            return None
        what = (f"{waiting} requests" if waiting >= self.max_waiting_requests
                else f"{waiting_tokens} prompt tokens")
        return RequestError(f"the engine is overloaded: {what} are waiting (limits: "
                            f"{self.max_waiting_requests} requests, {self.max_waiting_tokens} "
                            "tokens); try again later", 503, "service_unavailable",
                            "engine_overloaded", retry_after_s(waiting_tokens, tokens_per_s))


def check_deadline(deadline: float | None, now: float | None = None) -> RequestError | None:
    """The 504 for a deadline already past, else None."""
    if deadline is None:
        return None
    now = time.time() if now is None else now
    if deadline > now:
        return None
    return RequestError(f"the request's deadline passed {now - deadline:.2f} s before the "
                        "engine received it", 504, "timeout_error", "deadline_exceeded")
