"""The engine service on the real NATS with SmolLM2 (CPU): what one request sends cannot take it
down. Values the engine cannot use are 400s naming them (the seed that used to crash the step
loop among them), a passed deadline a 504 (at admission, or as an error frame while queued), a
full queue a 503 with retry_after_s, a grammar that cannot compile a 400; prompt logprobs come
in the first token frame; and the engine keeps serving throughout."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import (
    Admission,
    Cancel,
    GuidedDecoding,
    SamplingOptions,
    TokenFrame,
    TokenRequest,
)
from flotilla.libs.common.model_cache import ensure_default_model
from flotilla.libs.common.settings import EngineSettings
from flotilla.services.engine.service import EngineService
from tests.endpoints import NATS_URL

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646]


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[tuple[Bus, EngineService, str]]:
    model = f"engine-svc-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(NATS_URL, "engine-service-test")
    # one running sequence and one waiting request at most: overload is easy to reach
    service = EngineService(EngineSettings(
        nats_url=NATS_URL, model=str(ensure_default_model()), served_model_name=model,
        log_level="WARNING", kvcache_mem_mib=64, max_num_seqs=1, max_waiting_requests=1),
        bus)
    await service.start()
    try:
        yield bus, service, model
    finally:
        await service.stop()
        await bus.close()


def _request(model: str, **sampling: Any) -> TokenRequest:
    rid = f"r-{uuid.uuid4().hex[:8]}"
    deadline = sampling.pop("deadline", None)
    return TokenRequest(request_id=rid, model=model, prompt_token_ids=PROMPT,
                        sampling=SamplingOptions(**{"max_tokens": 4, **sampling}),
                        stream_subject=subjects.token_stream(rid), deadline=deadline)


async def _admit(bus: Bus, model: str, req: TokenRequest) -> Admission:
    return await bus.request(subjects.engine_generate(model), req, Admission, 30)


async def _generate(bus: Bus, model: str, req: TokenRequest) -> list[Any]:
    """The deltas of an accepted request (its error frame raises FlotillaError)."""
    reader = await bus.open_reader(req.stream_subject, TokenFrame, timeout=60)
    try:
        admission = await _admit(bus, model, req)
        assert admission.accepted, admission.error
        return [frame.data async for frame in reader if frame.kind == "data"]
    finally:
        await reader.close()


@pytest.mark.parametrize(("sampling", "param"), [
    ({"seed": 18446744073709551616, "temperature": 1.0}, "seed"),
    ({"seed": 2**63, "temperature": 1.0}, "seed"),
    ({"logit_bias": {10**7: 5.0}}, "logit_bias"),
    ({"logit_bias": {5: -250.0}}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"top_k": -7}, "top_k"),
])
async def test_values_the_engine_cannot_use_are_400s_naming_them(
        engine: tuple[Bus, EngineService, str], sampling: dict[str, Any], param: str) -> None:
    bus, service, model = engine
    refused = await _admit(bus, model, _request(model, **sampling))
    assert not refused.accepted and refused.error is not None
    assert refused.error.status == 400 and refused.error.param == param, refused.error
    assert service.crashed is None


async def test_the_largest_seed_is_served_and_the_engine_stays_up(
        engine: tuple[Bus, EngineService, str]) -> None:
    bus, service, model = engine
    frames = await _generate(bus, model, _request(model, seed=2**63 - 1, temperature=1.0))
    assert sum(len(f.token_ids) for f in frames) == 4 and service.crashed is None


async def test_prompt_logprobs_come_with_the_first_frame(
        engine: tuple[Bus, EngineService, str]) -> None:
    bus, _, model = engine
    frames = await _generate(bus, model, _request(model, temperature=0.0, prompt_logprobs=2))
    first = frames[0].prompt_logprobs
    assert first is not None and len(first) == len(PROMPT) and first[0] is None
    assert [e.token_id for e in first[1:]] == PROMPT[1:]
    assert all(len(e.top) == 2 and e.logprob <= 0 for e in first[1:])
    assert all(f.prompt_logprobs is None for f in frames[1:])


async def test_a_passed_deadline_is_a_504_at_admission(
        engine: tuple[Bus, EngineService, str]) -> None:
    bus, _, model = engine
    refused = await _admit(bus, model, _request(model, deadline=time.time() - 1))
    assert refused.error is not None and refused.error.status == 504
    assert refused.error.code == "deadline_exceeded"


async def test_a_bad_grammar_is_a_400_at_admission(
        engine: tuple[Bus, EngineService, str]) -> None:
    bus, _, model = engine
    bad = GuidedDecoding(kind="grammar", value="root ::= (")
    refused = await _admit(bus, model, _request(model, guided=bad))
    assert refused.error is not None and refused.error.status == 400
    assert refused.error.code == "invalid_grammar"


async def test_a_full_queue_is_a_503_with_retry_after_and_a_queued_deadline_a_504_frame(
        engine: tuple[Bus, EngineService, str]) -> None:
    bus, service, model = engine
    busy = _request(model, temperature=0.0, max_tokens=400, ignore_eos=True)
    busy_reader = await bus.open_reader(busy.stream_subject, TokenFrame, timeout=60)
    assert (await _admit(bus, model, busy)).accepted
    frames = aiter(busy_reader)
    await anext(frames)  # busy runs: the one sequence slot is taken
    queued = _request(model, deadline=time.time() + 1.5)
    queued_reader = await bus.open_reader(queued.stream_subject, TokenFrame, timeout=60)
    assert (await _admit(bus, model, queued)).accepted  # waits: max_num_seqs is 1
    refused = await _admit(bus, model, _request(model))
    assert refused.error is not None and refused.error.status == 503
    assert refused.error.code == "engine_overloaded"
    assert refused.error.retry_after_s is not None and 1 <= refused.error.retry_after_s <= 30
    t0 = time.monotonic()
    with pytest.raises(FlotillaError) as err:
        async for _ in queued_reader:
            pass
    assert err.value.status == 504 and err.value.info.code == "deadline_exceeded"
    assert "waiting in the queue" in err.value.info.message
    assert time.monotonic() - t0 < 5
    await bus.publish(subjects.CANCEL, Cancel(request_id=busy.request_id,
                                              reason="client_disconnect"))
    await busy_reader.close()
    await queued_reader.close()
    for _ in range(100):  # the queue drains: requests are admitted again
        if service.loop is not None and service.loop.queue_state().waiting == 0:
            break
        await asyncio.sleep(0.05)
    frames_after = await _generate(bus, model, _request(model))
    assert sum(len(f.token_ids) for f in frames_after) == 4
    assert service._engine_stats().requests_failed >= 1 and service.crashed is None


async def test_the_engine_is_built_and_stepped_on_one_thread(
        engine: tuple[Bus, EngineService, str]) -> None:
    """One thread, one OpenMP pool on CPU (loop.py): the thread that built the engine steps it."""
    import threading

    bus, service, model = engine
    assert service._engine is not None
    stepped: set[int] = set()
    step = service._engine.step

    def noting_step() -> Any:
        stepped.add(threading.get_ident())
        return step()

    service._engine.step = noting_step  # type: ignore[method-assign]
    try:
        await _generate(bus, model, _request(model))
    finally:
        del service._engine.step
    # the executor's one thread built the engine (it now runs the loop, so ask the executor)
    workers = {t.ident for t in service._engine_thread._threads}  # type: ignore[attr-defined]
    assert len(workers) == 1 and stepped == workers
