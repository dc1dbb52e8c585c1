"""Chaos: every service of the running suite, and its NATS server, killed (SIGKILL) and frozen
(SIGSTOP) in turn with 8 streams in flight, on the package's one suite (default model, CPU,
private NATS).

For each fault it checks, as a client and an operator would see it:
- every stream ends (finish_reason, SSE error event + [DONE], an HTTP error, or a closed
  connection), never hangs; a stream whose path the fault cuts ends within `END_BOUND_S` of
  the fault (the stream heartbeat timeout, 3 s, plus a second for the hop on a loaded host;
  losing NATS ends them at once);
- /ready and `flotilla status` say not ready within `DETECT_BOUND_S`, and stay so while the
  fault lasts (sampled every few hundred ms);
- the suite serves again within `RECOVER_BOUND_S[service]` (after a SIGCONT for a freeze, after
  the launcher's restart for a kill), and the first time /ready says 200 a request succeeds;
  `flotilla status` then says ready.
Each case prints what it measured (run with -s to see): end of the streams, /ready's flip and
the time to serving again.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest

from bench.sse_client import TERMINAL_ERRORS, Outcome, stream_chat
from flotilla.services.launcher.cli import main as flotilla
from tests.e2e.conftest import MODEL, SuiteHandle

STREAMS = 8
END_BOUND_S = 4.0
DETECT_BOUND_S = 3.5
READY_TIMEOUT_S = 2.5  # a /ready that takes longer counts as not ready (a frozen gateway)
RECOVER_BOUND_S = {"nats-server": 15.0, "gateway": 60.0, "tokenizer": 90.0, "engine": 240.0,
                   "tools": 60.0}
STORY = {"model": MODEL, "temperature": 0.8,
         "messages": [{"role": "user", "content": "Write a very long story about a lighthouse "
                                                  "keeper and a storm."}]}
SHORT = {"model": MODEL, "max_tokens": 2, "temperature": 0,
         "messages": [{"role": "user", "content": "Hi"}]}


@dataclass
class Case:
    service: str
    sig: signal.Signals
    in_path: bool  # does the fault cut a stream already running?
    streams: bool = True  # run streams through it (not for a frozen gateway: they would hang)

    @property
    def name(self) -> str:
        return f"{self.service}-{self.sig.name}"


CASES = [
    Case("tokenizer", signal.SIGKILL, True),
    Case("tokenizer", signal.SIGSTOP, True),
    Case("tools", signal.SIGKILL, False),
    Case("tools", signal.SIGSTOP, False),
    Case("nats-server", signal.SIGKILL, True),
    Case("nats-server", signal.SIGSTOP, True),
    Case("gateway", signal.SIGKILL, True),
    Case("gateway", signal.SIGSTOP, True, streams=False),
    Case("engine", signal.SIGSTOP, True),
    Case("engine", signal.SIGKILL, True),
]


def status(suite: SuiteHandle) -> tuple[int, str]:
    """`flotilla status --state-file ...` as an operator runs it: exit code and output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = flotilla(["status", "--state-file", str(suite.state_file)])
    return code, out.getvalue()


async def ready(http: httpx.AsyncClient) -> tuple[int | str, list[str]]:
    try:
        r = await http.get("/ready", timeout=READY_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return type(exc).__name__, []
    return r.status_code, list(r.json().get("reasons", [])) if r.status_code == 503 else []


async def serves(http: httpx.AsyncClient, timeout: float = 30) -> bool:
    try:
        r = await http.post("/v1/chat/completions", json=SHORT, timeout=timeout)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


@dataclass
class Attempt:
    sent: float  # seconds after the fault
    took: float
    ok: bool


async def watch_serving(http: httpx.AsyncClient, fault: float, log: list[Attempt]) -> None:
    """One short request after another from the fault on, until cancelled."""
    while True:
        sent = time.monotonic()
        ok = await serves(http, timeout=10)
        log.append(Attempt(sent - fault, time.monotonic() - sent, ok))
        await asyncio.sleep(0.1)


def serving_summary(log: list[Attempt]) -> str:
    failed = [a for a in log if not a.ok]
    if not failed:
        return f"no request failed (slowest {max((a.took for a in log), default=0):.2f}s)"
    back = next((a for a in log if a.ok and a.sent > failed[0].sent), None)
    return (f"requests failed from {failed[0].sent:.2f}s, served again "
            + (f"{back.sent + back.took:.2f}s after the fault" if back else "(not seen)"))


async def until_ready_and_serving(suite: SuiteHandle, http: httpx.AsyncClient,
                                  timeout: float) -> list[str]:
    """Poll /ready; the first 200 must be true: a request sent right then succeeds. Returns
    the last reasons /ready gave before it."""
    deadline = time.monotonic() + timeout
    last: list[str] = []
    while time.monotonic() < deadline:
        code, reasons = await ready(http)
        if code == 200:
            assert await serves(http), "/ready said 200 but a request failed"
            return last
        last = reasons or [str(code)]
        await asyncio.sleep(0.25)
    raise AssertionError(f"not ready within {timeout:g}s: {last} {suite.state()}")


async def check_status_is_true(suite: SuiteHandle, http: httpx.AsyncClient) -> bool:
    """`flotilla status` now: not ready (exit 2), or ready (exit 0) and then a request
    succeeds. Whether it said ready."""
    code, text = await asyncio.to_thread(status, suite)
    first = text.splitlines()[0]
    if code == 0:
        assert first.endswith(": ready") and await serves(http), text
        return True
    assert code == 2 and ": not ready: " in first, text
    return False


async def outage(suite: SuiteHandle, http: httpx.AsyncClient, case: Case, pid: int,
                 fault: float, streams: list[asyncio.Task[Outcome]]) -> tuple[float,
                                                                          list[Outcome]]:
    """While the fault lasts: /ready says not ready within the bound and stays so, `flotilla
    status` tells the truth, every stream ends. Then SIGCONT for a freeze. Returns when the
    first /ready that said not ready was sent, and the streams' outcomes."""
    try:
        flipped = None
        samples: list[tuple[float, int | str]] = []
        while time.monotonic() - fault < DETECT_BOUND_S + READY_TIMEOUT_S:
            sent = time.monotonic() - fault
            code, _ = await ready(http)
            samples.append((sent, code))
            if code != 200 and flipped is None:
                flipped = sent
            if flipped is not None and (case.sig == signal.SIGKILL
                                        or time.monotonic() - fault > DETECT_BOUND_S):
                break
            await asyncio.sleep(0.2)
        assert flipped is not None and flipped <= DETECT_BOUND_S, samples
        assert all(code != 200 for t, code in samples if t >= flipped), samples
        # a kill may already be repaired (NATS is back in about a second): then status must
        # say ready and mean it; a freeze lasts until SIGCONT, so it is never ready
        said_ready = await check_status_is_true(suite, http)
        assert not (said_ready and case.sig == signal.SIGSTOP)
        return flipped, list(await asyncio.gather(*streams))
    finally:
        if case.sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)


def check_outcomes(case: Case, outcomes: list[Outcome], fault: float) -> None:
    for o in outcomes:
        assert o.kind != "hung" and o.kind != "incomplete", o
    if case.in_path and case.streams:
        cut = [o for o in outcomes if o.ended > fault]
        assert cut, "every stream finished before the fault: nothing was tested"
        assert all(o.kind in TERMINAL_ERRORS for o in cut), cut
        assert max(o.ended - fault for o in cut) <= END_BOUND_S, [
            (o.kind, round(o.ended - fault, 2)) for o in cut]
    else:
        assert all(o.kind == "finished" for o in outcomes), outcomes  # not on their path


async def until_status_ready(suite: SuiteHandle, http: httpx.AsyncClient,
                             timeout: float) -> None:
    """`flotilla status` may lag /ready while a restarted tools service starts (requests are
    served meanwhile, without MCP tools): it must say ready, and mean it, within `timeout`."""
    deadline = time.monotonic() + timeout
    while not await check_status_is_true(suite, http):
        assert time.monotonic() < deadline, "flotilla status never said ready again"
        await asyncio.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_fault_ends_every_stream_and_the_suite_recovers(suite: SuiteHandle,
                                                               case: Case) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=suite.root_url, limits=limits) as http:
        await until_ready_and_serving(suite, http, RECOVER_BOUND_S["engine"])
        state = suite.state()
        pid = state["pids"][case.service]

        flowing = [asyncio.Event() for _ in range(STREAMS)]
        streams: list[asyncio.Task[Outcome]] = []
        if case.streams:
            body = {**STORY, "max_tokens": 400 if case.in_path else 16}
            streams = [asyncio.create_task(stream_chat(
                http, {**body, "seed": i}, stall_s=60, on_token=lambda n, e=flowing[i]: (
                    e.set() if n >= 2 else None))) for i in range(STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in flowing)), 180)

        fault = time.monotonic()
        os.kill(pid, case.sig)
        attempts: list[Attempt] = []
        watch = asyncio.create_task(watch_serving(http, fault, attempts))
        try:
            flipped, outcomes = await outage(suite, http, case, pid, fault, streams)
            resumed = time.monotonic()
            check_outcomes(case, outcomes, fault)
            last = await until_ready_and_serving(suite, http, RECOVER_BOUND_S[case.service])
            served = time.monotonic()
            await until_status_ready(suite, http, RECOVER_BOUND_S[case.service])
        finally:
            watch.cancel()  # a failed check must not leave it polling
        after = suite.state()
        if case.sig == signal.SIGKILL:
            assert after["pids"][case.service] != pid
            assert after["restarts"][case.service] == state["restarts"][case.service] + 1
        ends = [o.ended - fault for o in outcomes if o.ended > fault]
        print(f"\n{case.name}: streams ended {max(ends, default=0):.2f}s after the fault "
              f"({', '.join(sorted({o.kind for o in outcomes})) or 'none'}); /ready not ready "
              f"from {flipped:.2f}s; {serving_summary(attempts)}"
              + (f"; SIGCONT at {resumed - fault:.2f}s" if case.sig == signal.SIGSTOP else "")
              + f"; /ready 200 and a request served {served - fault:.2f}s after the fault"
              + (f" (last reasons: {'; '.join(last)})" if last else ""))
