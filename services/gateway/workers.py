"""Several gateway processes on one port (`FLOTILLA_GATEWAY_WORKERS` > 1).

Rules:
- With one worker the gateway is a single process, as it always was. With N > 1,
  `python -m flotilla.services.gateway` becomes a parent that reserves the port (bound with
  SO_REUSEPORT, never listening: port 0 becomes a real port here) and starts N workers
  (`python -m flotilla.services.gateway --worker`, that port in `FLOTILLA_PORT`), each listening on
  a socket of its own bound with SO_REUSEPORT. Linux spreads new connections evenly over the
  workers' sockets (a hash of the addresses), so a burst of connections is split between them;
  one shared socket would not do that: whichever worker wakes first accepts everything queued.
  A connection (with all its keep-alive requests) stays with the worker that accepted it.
- Each worker is a whole gateway: its own event loop, NATS connection, registry, tools cache,
  discovery instance id and spans. Nothing is shared in memory, and nothing needs to be: the
  registry is the Store (Redis when configured; without it every worker records every
  announcement in a store of its own), the tools list is a per-worker cache invalidated by
  announcements every worker receives, and a request's streams and cancels belong to the worker
  holding its connection. Without Redis a model's `created` is each worker's first sighting
  (the same second, bar a tick between them).
- Metrics: the parent gives its workers one directory for prometheus-client's multiprocess
  mode (a temporary one it removes at exit, unless `PROMETHEUS_MULTIPROC_DIR` names one), so
  /metrics on any worker shows the whole gateway (services/gateway/metrics.py).
- The parent serves nothing and holds no NATS connection. SIGTERM or SIGINT: it sends SIGTERM
  to every worker (each drains: libs/common/service.py), waits up to `drain_timeout_s` plus a
  few seconds and SIGKILLs the rest. A worker that exits on its
  own makes the parent stop the others and exit 1, so whoever supervises the gateway (the
  launcher, a container's restart policy) restarts it whole.
- Workers are spawned from the parent's main thread with PR_SET_PDEATHSIG, so a parent killed
  with SIGKILL leaves no orphans (the launcher's rule for its own children).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from flotilla.libs.common import telemetry
from flotilla.libs.common.settings import GatewaySettings
from flotilla.services.gateway.service import bind_socket
from flotilla.services.launcher.processes import child_preexec

log = logging.getLogger(__name__)

WORKER_ARG = "--worker"
WORKER_ARGV = [sys.executable, "-m", "flotilla.services.gateway", WORKER_ARG]
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # GatewaySettings.prometheus_multiproc_dir


class WorkerPool:
    """The parent's side: `WorkerPool(settings).run()` blocks until stopped; the exit code."""

    poll_s = 0.1

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        # a worker drains, then needs its stream grace (2 s) plus closing NATS
        self.stop_grace_s = settings.drain_timeout_s + 6.0
        self._metrics_dir: Path | None = None  # made here when the operator named none
        self.procs: list[subprocess.Popen[bytes]] = []
        self._reserved: socket.socket | None = None  # holds the port; never listens
        self._stop_signal: int | None = None

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        self._stop_signal = signum

    def start(self) -> None:
        self._reserved = bind_socket(self.settings.host, self.settings.port, reuse_port=True)
        port = self._reserved.getsockname()[1]
        env = {**os.environ, "FLOTILLA_PORT": str(port)}
        if self.settings.prometheus_multiproc_dir is None:
            self._metrics_dir = Path(tempfile.mkdtemp(prefix="flotilla-gateway-metrics-"))
            env[MULTIPROC_ENV] = str(self._metrics_dir)
        try:
            for _ in range(self.settings.gateway_workers):
                self.procs.append(subprocess.Popen(WORKER_ARGV, env=env, stdin=subprocess.DEVNULL,
                                                   preexec_fn=child_preexec))
        except BaseException:
            self.stop()
            raise
        log.info("gateway: %d workers (pids %s) on %s:%d", len(self.procs),
                 ", ".join(str(p.pid) for p in self.procs), self.settings.host, port)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("gateway worker %d did not stop in time: killed", p.pid)
                p.kill()
                p.wait()
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            self._metrics_dir = None

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.start()
        code = 0
        while self._stop_signal is None:
            died = [p for p in self.procs if p.poll() is not None]
            if died:
                log.error("gateway worker %d exited with code %s: stopping the others",
                          died[0].pid, died[0].returncode)
                code = 1
                break
            time.sleep(self.poll_s)
        self.stop()
        return code


def run_workers(settings: GatewaySettings) -> int:
    """The parent's main: the exit code (0 when stopped by a signal, 1 when a worker died)."""
    telemetry.setup_logging(settings.log_level)
    return WorkerPool(settings).run()
