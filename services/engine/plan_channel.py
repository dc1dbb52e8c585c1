"""The plan channel: framed messages from rank 0 to every worker rank of a tensor-parallel pod.

Rules:
- Rank 0 listens (loopback when all ranks share the host); each worker connects once and
  authenticates with the pod's random token and its rank. After that rank 0 only sends
  (`broadcast`) and a worker only receives, except that a worker about to die sends one report
  (its traceback) with `report`.
- A closed connection is a dead peer: a worker's `recv` returns None (rank 0 is gone: exit), and
  rank 0's monitor (the executor) turns a report or an end-of-file into the pod's failure.
- Frames: 8-byte big-endian length, then the payload. Sockets run with TCP_NODELAY: a plan is
  a few hundred bytes and must not wait for Nagle.
"""

from __future__ import annotations

import hmac
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable

_HEADER = struct.Struct("!Q")
_HELLO = struct.Struct("!16sI")  # token, rank
TOKEN_BYTES = 16

Address = tuple[str, int]


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame's payload, or None when the peer closed the connection."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    return _recv_exact(sock, _HEADER.unpack(header)[0])


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class PlanServer:
    """Rank 0's end: `accept` the workers, then `broadcast` each plan to all of them."""

    def __init__(self, bind_host: str, advertise_host: str, num_workers: int) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.num_workers = num_workers
        self._listener = socket.create_server((bind_host, 0))
        self.address: Address = (advertise_host, self._listener.getsockname()[1])
        self.workers: dict[int, socket.socket] = {}  # rank -> connection

    def accept(self, timeout_s: float, check: Callable[[], None] = lambda: None) -> None:
        """Wait until every worker has connected; `check` runs between waits and may raise
        (e.g. a worker process died while starting)."""
        deadline = time.monotonic() + timeout_s
        while len(self.workers) < self.num_workers:
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = self.num_workers - len(self.workers)
                raise TimeoutError(f"{missing} tensor-parallel worker(s) did not connect within "
                                   f"{timeout_s:.0f} s")
            ready, _, _ = select.select([self._listener], [], [], min(left, 0.5))
            if ready:
                self._admit(*self._listener.accept())

    def _admit(self, conn: socket.socket, _: object) -> None:
        conn.settimeout(10.0)
        hello = _recv_exact(conn, _HELLO.size)
        conn.settimeout(None)
        if hello is None:
            conn.close()
            return
        token, rank = _HELLO.unpack(hello)
        if not hmac.compare_digest(token, self.token) or not 0 < rank <= self.num_workers \
                or rank in self.workers:
            conn.close()  # not one of ours
            return
        _tune(conn)
        self.workers[rank] = conn

    def broadcast(self, payload: bytes) -> None:
        frame = _HEADER.pack(len(payload)) + payload
        for conn in self.workers.values():
            conn.sendall(frame)

    def close(self) -> None:
        self._listener.close()
        for conn in self.workers.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self.workers.clear()


class PlanClient:
    """A worker's end: `recv` plans; `report` a fatal error before exiting."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def connect(cls, address: Address, token: bytes, rank: int,
                timeout_s: float = 60.0) -> PlanClient:
        sock = socket.create_connection(address, timeout=timeout_s)
        sock.settimeout(None)
        _tune(sock)
        sock.sendall(_HELLO.pack(token, rank))
        return cls(sock)

    def recv(self) -> bytes | None:
        try:
            return recv_frame(self._sock)
        except (ConnectionError, OSError):
            return None

    def report(self, text: str) -> None:
        payload = text.encode(errors="replace")
        try:
            self._sock.sendall(_HEADER.pack(len(payload)) + payload)
        except OSError:
            pass  # rank 0 is gone too

    def close(self) -> None:
        self._sock.close()
