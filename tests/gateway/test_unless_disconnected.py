"""routes.unless_disconnected: the work runs in the caller's task; a client that leaves first
cancels it and the choices (ClientGone); nothing leaks into the task afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from flotilla.services.gateway.routes import ClientGone, unless_disconnected


class Client:
    """A Request stand-in: receive() returns http.disconnect once `leave()` is called."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


class Streams:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def cancel(self, reason: str) -> None:
        self.calls.append(f"cancel:{reason}")

    def close(self) -> None:
        self.calls.append("close")


async def test_the_work_runs_in_the_callers_task_and_returns_its_result() -> None:
    caller = asyncio.current_task()
    ran_in: list[Any] = []

    async def work() -> int:
        ran_in.append(asyncio.current_task())
        await asyncio.sleep(0)
        return 7

    streams = Streams()
    assert await unless_disconnected(Client(), work(), streams) == 7  # type: ignore[arg-type]
    assert ran_in == [caller] and streams.calls == []


async def test_a_client_that_leaves_first_cancels_the_work_and_the_choices() -> None:
    client, streams = Client(), Streams()
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    asyncio.get_running_loop().call_later(0.05, client.leave)
    with pytest.raises(ClientGone):
        await unless_disconnected(client, work(), streams)  # type: ignore[arg-type]
    assert cancelled.is_set()
    assert streams.calls == ["cancel:client_disconnect", "close"]
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the task carries on normally
    await asyncio.sleep(0.01)


async def test_a_disconnect_after_the_work_finished_cancels_nothing_later() -> None:
    client, streams = Client(), Streams()

    async def work() -> str:
        client.leave()  # the watcher completes, but only after the work returns
        return "done"

    assert await unless_disconnected(client, work(), streams) == "done"  # type: ignore[arg-type]
    await asyncio.sleep(0.02)  # would raise CancelledError if a late cancel hit this task
    assert streams.calls == []


async def test_a_cancellation_from_elsewhere_is_not_taken_for_a_disconnect() -> None:
    client, streams = Client(), Streams()

    async def handler() -> None:
        await unless_disconnected(client, asyncio.sleep(30), streams)  # type: ignore[arg-type]

    task = asyncio.ensure_future(handler())
    await asyncio.sleep(0.01)
    task.cancel()  # e.g. the server shutting down
    with pytest.raises(asyncio.CancelledError):
        await task
    assert streams.calls == []
