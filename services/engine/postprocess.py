"""What a launched step's sampled tokens do to their requests (the engine's postprocess).

Rules:
- When a step is launched, every request it samples for gets a PLACEHOLDER_TOKEN at the end of
  its token_ids (`add_placeholders`); its index is kept with the launched step (`InFlight`).
- When the step's tokens arrive (`write_tokens`), each overwrites its placeholder, unless its
  request was aborted or finished while the step ran. The request then finishes with 'stop'
  on one of its stop ids (not before min_tokens) or 'length' at its max_tokens, dropping any
  placeholder of a step launched since; otherwise it yields a one-token RequestOutput.
- The first output of a request that asked for prompt logprobs carries them.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.services.engine.request import Request, RequestStatus
from flotilla.services.engine.request_output import RequestOutput, request_output
from flotilla.services.engine.scheduler import PLACEHOLDER_TOKEN, ScheduledRequest, Scheduler
from flotilla.services.engine.step_output import LaunchedStep, RunnerOutput


@dataclass
class InFlight:
    """A launched step whose tokens have not been postprocessed: for each sampling request (in
    row order) the index of its placeholder in token_ids."""

    launched: LaunchedStep
    slots: list[tuple[Request, int]]


def add_placeholders(scheduler: Scheduler, requests: list[ScheduledRequest]
                     ) -> list[tuple[Request, int]]:
    """A placeholder token for every request of the step that samples; their slots."""
    slots = []
    for sr in requests:
        if sr.samples:
            request = scheduler.requests[sr.request_id]
            slots.append((request, len(request.token_ids)))
            request.token_ids.append(PLACEHOLDER_TOKEN)
    return slots


@dataclass
class Written:
    outputs: list[RequestOutput]
    generated: int  # tokens written
    finished: int  # requests finished by them


def write_tokens(scheduler: Scheduler, inflight: InFlight, result: RunnerOutput) -> Written:
    """Write the step's tokens over their placeholders; finish the requests they end."""
    live = scheduler.requests
    written = Written([], 0, 0)
    outputs = written.outputs
    # Runs for every sampled token: the unfinished case builds its output inline.
    for (request, index), token, logprobs in zip(inflight.slots, result.token_ids,
                                                 result.logprobs, strict=True):
        if live.get(request.request_id) is not request:
            continue  # aborted (or finished) while its step ran
        request.token_ids[index] = token
        written.generated += 1
        num_output = index + 1 - request.num_prompt_tokens
        status = None
        if token in request.stop_ids and num_output >= request.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
        elif num_output >= request.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        lps = None if logprobs is None else [logprobs]
        prompt_lps = None
        if num_output == 1 and request.wants_prompt_logprobs:
            request.wants_prompt_logprobs = False
            prompt_lps = request.prompt_logprobs
        if status is None:
            outputs.append(RequestOutput(
                request.request_id, [token], False, None, request.num_prompt_tokens,
                max(request.num_cached_tokens, 0), num_output, lps,
                prompt_logprobs=prompt_lps))
            continue
        del request.token_ids[index + 1:]  # a placeholder of a step launched since
        scheduler.finish_request(request.request_id, status)
        written.finished += 1
        out = request_output(request, [token], lps, num_output)
        out.prompt_logprobs = prompt_lps
        outputs.append(out)
    return written
