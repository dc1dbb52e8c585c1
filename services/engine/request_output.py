"""What one engine step produced for one request (`RequestOutput`), and how a request's state
becomes one (`request_output`). engine.py re-exports RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flotilla.services.engine.request import Request, RequestStatus, TokenLogprobs
from flotilla.services.engine.request_error import RequestError


@dataclass
class RequestOutput:
    """What one step produced for one request (new_token_ids is empty for an abort or error)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | 'error' once finished
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    stop_token_id: int | None = None  # the eos / stop id that ended the request, if any
    error: RequestError | None = None  # why it finished with 'error'
    # with prompt_logprobs, on its first output: one entry per prompt token (the first None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    pooled: torch.Tensor | None = None  # a pooling request's vector, float32 on the host


def request_output(
    request: Request,
    new_token_ids: list[int],
    logprobs: list[TokenLogprobs] | None = None,
    num_output_tokens: int | None = None,
) -> RequestOutput:
    """`request`'s output for this step: `new_token_ids`, and its finish state (a stopped
    request's stop id is its last token)."""
    stop_id = None
    if request.status is RequestStatus.FINISHED_STOPPED:
        stop_id = request.token_ids[-1]
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finished=request.is_finished,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_output_tokens=(
            request.num_output_tokens if num_output_tokens is None else num_output_tokens
        ),
        logprobs=logprobs,
        stop_token_id=stop_id,
        error=request.error,
    )
