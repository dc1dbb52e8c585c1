"""The engine's results as the bus messages its service sends (libs/common/messages.py):
errors as ErrorInfo, sampled and prompt logprobs as TokenLogprob lists."""

from __future__ import annotations

from flotilla.libs.common.messages import ErrorInfo, TokenLogprob
from flotilla.services.engine.request import TokenLogprobs
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.request_output import RequestOutput


def error_info(error: RequestError) -> ErrorInfo:
    return ErrorInfo(
        status=error.status,
        type=error.type,
        message=error.message,
        param=error.param,
        code=error.code,
        retry_after_s=error.retry_after_s,
    )


def prompt_logprobs(entries: list[TokenLogprobs | None]) -> list[TokenLogprob | None]:
    return [
        None if e is None else TokenLogprob(token_id=e.token_id, logprob=e.logprob, top=list(e.top))
        for e in entries
    ]


def logprobs(out: RequestOutput) -> list[TokenLogprob] | None:
    raw = out.logprobs
    if not raw:
        return None
    return [TokenLogprob(token_id=t, logprob=lp, top=list(top)) for t, lp, top in raw]
