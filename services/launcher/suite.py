"""The local suite: model, NATS, and the four services as supervised child processes.

`start_suite(options)` resolves the model once (the first run downloads it with a progress bar),
finds or starts NATS, starts gateway, tokenizer, engine and tools, waits until they are ready,
and writes the state file; it returns a `Suite` to poll (restarts) and stop. The CLI's `up` is
this plus signal handling; tests can call it directly, overriding a service's command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from libs.common.model_cache import resolve_model, served_name
from services.launcher.nats_server import NatsServer, ensure_nats, free_port
from services.launcher.processes import ChildSpec, service_spec
from services.launcher.readiness import Probe, probe_once, wait_ready
from services.launcher.state import SuiteState, default_state_file
from services.launcher.supervisor import RestartPolicy, Supervisor
from services.tools.config import load_mcp_config

log = logging.getLogger(__name__)

SERVICES = ("gateway", "tokenizer", "engine", "tools")
_ANY_HOST = ("0.0.0.0", "::", "")


class SuiteError(RuntimeError):
    """The suite could not start; everything it had started is stopped again."""


class StopRequested(SuiteError):
    pass


@dataclass
class SuiteOptions:
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str = "nats://127.0.0.1:4222"
    mcp_config: Path | None = None
    served_model_name: str | None = None
    log_level: str = "INFO"
    state_file: Path | None = None
    start_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    tp: int | None = None  # engine tensor-parallel ranks (FLOTILLA_TP)
    device_ids: str | None = None  # "0,1": GPU of each engine rank (FLOTILLA_DEVICE_IDS)
    isq: str | None = None  # in-situ weight quantization of the engine (FLOTILLA_ISQ)
    fp8_kvcache: bool = False  # fp8 KV cache of the engine (FLOTILLA_KV_CACHE_DTYPE=fp8)
    ui: bool = False  # the gateway serves the chat web UI at / (FLOTILLA_UI)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    commands: dict[str, list[str]] = field(default_factory=dict)
    """Replace a service's `python -m services.<name>` (tests run stand-ins this way)."""


class Suite:
    def __init__(self, options: SuiteOptions):
        self.options = options
        self.stop_requested = False
        self.nats: NatsServer | None = None
        self.supervisor: Supervisor | None = None
        self.state: SuiteState | None = None
        self.state_file: Path | None = None
        self._health_url = ""
        self._next_probe = 0.0
        self._restarts: dict[str, int] = {}

    @property
    def url(self) -> str:
        assert self.state is not None
        return self.state.gateway_url

    def start(self) -> Suite:
        opts = self.options
        try:
            if opts.mcp_config:
                load_mcp_config(opts.mcp_config)  # a broken file fails here, before any start
            path = resolve_model(opts.model)
            model = (opts.served_model_name or os.environ.get("FLOTILLA_SERVED_MODEL_NAME")
                     or served_name(opts.model, path))
            port = opts.port or free_port(opts.host if opts.host not in _ANY_HOST else "127.0.0.1")
            self.state_file = opts.state_file or default_state_file(port)
            log_dir = self.state_file.with_name(self.state_file.stem + "-logs")
            nats_url, self.nats = ensure_nats(opts.nats_url, log_dir / "nats-server.log")
            host = "127.0.0.1" if opts.host in _ANY_HOST else opts.host
            self.state = SuiteState(
                launcher_pid=os.getpid(), gateway_url=f"http://{host}:{port}/v1",
                nats_url=nats_url, model=model, model_path=str(path), log_dir=str(log_dir))
            self.supervisor = Supervisor(self._specs(nats_url, port, path, model), log_dir,
                                         opts.restart, on_change=self.write_state)
            log.info("starting %s (logs in %s, state in %s)", ", ".join(SERVICES), log_dir,
                     self.state_file)
            self.supervisor.start()
            self._health_url = f"http://{host}:{port}/health"
            asyncio.run(wait_ready(self._probe(), opts.start_timeout_s, self._check_alive))
        except BaseException as exc:
            self.stop()
            if isinstance(exc, SuiteError):
                raise
            if isinstance(exc, OSError | RuntimeError | ValueError):  # NotReady included
                raise SuiteError(str(exc)) from exc
            raise
        self.state.ready = True
        self._restarts = self.supervisor.restarts()
        self.write_state()
        return self

    def _specs(self, nats_url: str, port: int, model_path: Path, model: str) -> list[ChildSpec]:
        opts = self.options
        common = {"FLOTILLA_NATS_URL": nats_url, "FLOTILLA_LOG_LEVEL": opts.log_level}
        extra: dict[str, dict[str, str]] = {
            "gateway": {"FLOTILLA_HOST": opts.host, "FLOTILLA_PORT": str(port),
                        **({"FLOTILLA_UI": "1"} if opts.ui else {})},
            "tokenizer": {"FLOTILLA_MODEL": str(model_path), "FLOTILLA_SERVED_MODEL_NAME": model},
            "engine": {"FLOTILLA_MODEL": str(model_path), "FLOTILLA_SERVED_MODEL_NAME": model,
                       **({"FLOTILLA_TP": str(opts.tp)} if opts.tp else {}),
                       **({"FLOTILLA_DEVICE_IDS": opts.device_ids} if opts.device_ids else {}),
                       **({"FLOTILLA_ISQ": opts.isq} if opts.isq else {}),
                       **({"FLOTILLA_KV_CACHE_DTYPE": "fp8"} if opts.fp8_kvcache else {})},
            "tools": ({"FLOTILLA_MCP_CONFIG": str(Path(opts.mcp_config).resolve())}
                      if opts.mcp_config else {}),
        }
        specs = []
        for name in SERVICES:
            spec = service_spec(name, {**common, **extra[name]})
            if name in opts.commands:
                spec = ChildSpec(name, opts.commands[name], spec.env)
            specs.append(spec)
        return specs

    def _check_alive(self) -> None:
        if self.stop_requested:
            raise StopRequested("stopped while starting")
        assert self.supervisor is not None
        for name, code in self.supervisor.dead().items():
            child = self.supervisor.children[name]
            raise SuiteError(f"{name} exited with code {code} while starting; last lines of "
                             f"{child.log_path}:\n{child.tail(30).rstrip()}")

    def write_state(self) -> None:
        if self.state is None or self.state_file is None or self.supervisor is None:
            return
        self.state.pids = {"nats-server": self.nats.pid if self.nats else None,
                           **self.supervisor.pids()}
        self.state.restarts = self.supervisor.restarts()
        self.state.write(self.state_file)

    def _probe(self) -> Probe:
        return Probe(self._health_url, self.state.nats_url if self.state else "",
                     [s for s in SERVICES if s != "gateway"])

    def poll(self) -> None:
        """Restart dead children and keep `ready` in the state file true: false from a death
        until the restarted service answers health again. Call every few hundred ms from the
        thread that started the suite (children die with the thread that spawned them)."""
        if self.supervisor is None or self.state is None:
            return
        self.supervisor.poll()
        if self.supervisor.dead() or self.supervisor.restarts() != self._restarts:
            self._restarts = self.supervisor.restarts()
            if self.state.ready:
                self.state.ready = False
                self.write_state()
            return
        if not self.state.ready and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + 1.0
            if asyncio.run(probe_once(self._probe())):
                self.state.ready = True
                self.write_state()
                log.info("all services are ready again")

    def serve_forever(self, interval_s: float = 0.2) -> None:
        while not self.stop_requested:
            self.poll()
            time.sleep(interval_s)

    def stop(self) -> None:
        """Stop the services, then our NATS (if we started one); remove the state file."""
        if self.supervisor is not None:
            self.supervisor.stop(self.options.stop_grace_s)
        if self.nats is not None:
            self.nats.stop()
        if self.state_file is not None and self.state is not None:
            self.state_file.unlink(missing_ok=True)
            self.state = None

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def start_suite(options: SuiteOptions) -> Suite:
    """Start everything and wait until it is ready; raises SuiteError (with the failing child's
    log) if it cannot, leaving nothing running."""
    return Suite(options).start()
