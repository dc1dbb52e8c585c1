"""The local suite: model, NATS, and the four services as supervised child processes.

`start_suite(options)` resolves the model once (the first run downloads it with a progress bar),
starts NATS (or joins the one named), starts gateway, tokenizer, engine and tools, waits until
they are ready, and writes the state file; it returns a `Suite` to poll (restarts, readiness)
and stop. The CLI's `up` is this plus signal handling; tests can call it directly, overriding a
service's command.

Rules:
- Before it starts anything, a launcher takes its state file's lock and checks that the
  gateway's port is free; failing either is an error that touches no other suite's files.
- NATS (nats_server.py, `plan_nats`): private unless a URL is given. A private nats-server is
  a supervised child like the services, started and reachable before them, restarted on the
  same port when it dies (its own backoff, `nats_restart`); clients reconnect on their own.
  It requires a token generated for this start (`nats_auth`), which reaches the services as
  FLOTILLA_NATS_TOKEN in their environment and `flotilla status` through a file only the
  owner can read (`nats_token_file` in the state); it is never logged. A shared NATS is
  reached with the FLOTILLA_NATS_* credentials of the launcher's settings (the services
  inherit the same environment).
- Metrics: the tokenizer, engine and tools each get a free port for /metrics (the gateway
  serves it on its own port); the state file lists every URL (`metrics_urls`).
- Stopping: SIGTERM to every service, which drains (libs/common/service.py) for up to
  `drain_timeout_s`; SIGKILL `stop_grace_s` later.
- Readiness: a `Prober` thread checks every 0.5 s (readiness.py: the gateway's /ready plus each
  NATS service's health). `poll()` combines its newest verdict with what the supervisors know
  at that moment: a dead child is not ready, and a verdict that began before the latest death
  or restart does not count. The state file's `ready` / `reasons` and the console follow every
  change ("not ready: ...", "ready again"); unchanged reasons are repeated every `remind_s`.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from flotilla.libs.common.model_cache import resolve_model, served_name
from flotilla.libs.common.nats_auth import NatsSecurity
from flotilla.services.launcher.nats_server import (
    NatsPlan,
    NatsServer,
    free_port,
    plan_nats,
    reachable,
)
from flotilla.services.launcher.processes import ChildSpec, service_spec
from flotilla.services.launcher.readiness import Probe, Prober, Verdict
from flotilla.services.launcher.state import StateFileLock, SuiteState, default_state_file
from flotilla.services.launcher.supervisor import RestartPolicy, Supervisor
from flotilla.services.tools.config import load_mcp_config

log = logging.getLogger(__name__)

SERVICES = ("gateway", "tokenizer", "engine", "tools")
NATS_SERVICES = [s for s in SERVICES if s != "gateway"]
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
    nats_url: str | None = None  # None: a private nats-server on a free port
    mcp_config: Path | None = None
    served_model_name: str | None = None
    log_level: str = "INFO"
    state_file: Path | None = None
    run_dir: Path | None = None  # where the state file goes without state_file (state.run_dir)
    start_timeout_s: float = 600.0
    drain_timeout_s: float = 20.0  # each service's drain on SIGTERM (FLOTILLA_DRAIN_TIMEOUT_S)
    stop_grace_s: float | None = None  # None: drain_timeout_s + 5, then SIGKILL
    remind_s: float = 30.0  # unchanged "waiting" / "not ready" reasons are logged this often
    tp: int | None = None  # engine tensor-parallel ranks (FLOTILLA_TP)
    device_ids: str | None = None  # "0,1": GPU of each engine rank (FLOTILLA_DEVICE_IDS)
    isq: str | None = None  # in-situ weight quantization of the engine (FLOTILLA_ISQ)
    fp8_kvcache: bool = False  # fp8 KV cache of the engine (FLOTILLA_KV_CACHE_DTYPE=fp8)
    # MoE expert offload settings of the engine (FLOTILLA_CPU_MOE, FLOTILLA_N_CPU_MOE, ...)
    moe_offload: dict[str, str] = field(default_factory=dict)
    ui: bool = False  # the gateway serves the chat web UI at / (FLOTILLA_UI)
    api_keys: str | None = None  # keys the gateway accepts, comma-separated (FLOTILLA_API_KEYS)
    nats_auth: bool = True  # a private nats-server requires a token generated for this start
    nats_security: NatsSecurity | None = None  # how to reach a shared NATS (from settings)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    nats_restart: RestartPolicy = field(
        default_factory=lambda: RestartPolicy(min_backoff_s=0.2, max_backoff_s=10.0))
    commands: dict[str, list[str]] = field(default_factory=dict)
    """Replace a service's `python -m flotilla.services.<name>` (tests run stand-ins this way)."""


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise SuiteError(f"the gateway port {port} on {host or '*'} is in use "
                             f"({exc.strerror}); pick another with --port") from None


class Suite:
    def __init__(self, options: SuiteOptions):
        self.options = options
        self.stop_requested = False
        self.nats: NatsServer | None = None
        self.nats_token: SecretStr | None = None
        self.infra: Supervisor | None = None  # the private nats-server, when we run one
        self.supervisor: Supervisor | None = None  # the four services
        self.prober: Prober | None = None
        self.state: SuiteState | None = None
        self.state_file: Path | None = None
        self._lock: StateFileLock | None = None
        self._changed_at = 0.0  # monotonic time of the latest death or restart
        self._restarts: dict[str, int] = {}
        self._metrics_ports: dict[str, int] = {}  # tokenizer, engine, tools -> /metrics port
        self._said: list[str] = []  # the reasons last logged
        self._said_at = 0.0

    @property
    def url(self) -> str:
        assert self.state is not None
        return self.state.gateway_url

    def _supervisors(self) -> list[Supervisor]:
        return [s for s in (self.infra, self.supervisor) if s is not None]

    def start(self) -> Suite:
        opts = self.options
        try:
            if opts.mcp_config:
                load_mcp_config(opts.mcp_config)  # a broken file fails here, before any start
            host = "127.0.0.1" if opts.host in _ANY_HOST else opts.host
            port = opts.port or free_port(host)
            self.state_file = opts.state_file or default_state_file(port, opts.run_dir)
            self._lock = StateFileLock(self.state_file)
            self._lock.acquire()
            if opts.port:
                check_port_free(opts.host, port)
            path = resolve_model(opts.model)
            model = opts.served_model_name or served_name(opts.model, path)
            log_dir = self.state_file.with_name(self.state_file.stem + "-logs")
            plan = plan_nats(opts.nats_url)
            self.state = SuiteState(
                launcher_pid=os.getpid(), gateway_url=f"http://{host}:{port}/v1",
                nats_url=plan.url, nats_private=plan.private, model=model,
                model_path=str(path), log_dir=str(log_dir))
            security = opts.nats_security
            if plan.private:
                token = secrets.token_urlsafe(32) if opts.nats_auth else None
                self._start_nats(plan, log_dir, token)
                if token is not None:
                    security = NatsSecurity(token=SecretStr(token))
                    self.state.nats_token_file = str(self._write_token(token))
            else:
                log.info("using the NATS server at %s (shared: given explicitly)", plan.url)
            self.nats_token = security.token if security else None
            self._metrics_ports = {name: free_port(host) for name in NATS_SERVICES}
            self.state.metrics_urls = {
                "gateway": f"http://{host}:{port}/metrics",
                **{name: f"http://{host}:{p}/metrics" for name, p in self._metrics_ports.items()}}
            self.supervisor = Supervisor(self._specs(plan.url, port, path, model), log_dir,
                                         opts.restart, on_change=self._children_changed)
            log.info("starting %s (logs in %s, state in %s)", ", ".join(SERVICES), log_dir,
                     self.state_file)
            self.supervisor.start()
            self.prober = Prober(Probe(f"http://{host}:{port}/ready", plan.url, NATS_SERVICES,
                                       security))
            self.prober.start()
            self._wait_ready(opts.start_timeout_s)
        except BaseException as exc:
            self.stop()
            if isinstance(exc, SuiteError):
                raise
            if isinstance(exc, OSError | RuntimeError | ValueError):  # StateFileBusy included
                raise SuiteError(str(exc)) from exc
            raise
        self.state.serving = True
        self._restarts = self.restarts()
        self.write_state()
        return self

    def _write_token(self, token: str) -> Path:
        """The private server's token, for `flotilla status` (its owner only may read it)."""
        assert self.nats is not None
        path = self.nats.store / "token"
        path.touch(mode=0o600)
        path.write_text(token)
        return path

    def _start_nats(self, plan: NatsPlan, log_dir: Path, token: str | None) -> None:
        self.nats = NatsServer(plan.port, plan.host, token=token)
        self.infra = Supervisor([self.nats.spec()], log_dir, self.options.nats_restart,
                                on_change=self._children_changed)
        self.infra.start()
        deadline = time.monotonic() + 10.0
        while not reachable(plan.url, timeout=0.5):
            self._check_alive()
            if time.monotonic() > deadline:
                raise SuiteError(f"nats-server did not accept connections at {plan.url} "
                                 f"within 10s; see {log_dir / 'nats-server.log'}")
            time.sleep(0.05)
        log.info("started a private nats-server (pid %s) at %s%s",
                 self.infra.pids()["nats-server"], plan.url,
                 " (clients need its generated token)" if token else "")

    def _specs(self, nats_url: str, port: int, model_path: Path, model: str) -> list[ChildSpec]:
        opts = self.options
        common = {"FLOTILLA_NATS_URL": nats_url, "FLOTILLA_LOG_LEVEL": opts.log_level,
                  "FLOTILLA_DRAIN_TIMEOUT_S": str(opts.drain_timeout_s)}
        if self.nats_token is not None and self.nats is not None:  # the private server's
            common["FLOTILLA_NATS_TOKEN"] = self.nats_token.get_secret_value()
        metrics = {name: {"FLOTILLA_METRICS_PORT": str(p), "FLOTILLA_METRICS_HOST": opts.host}
                   for name, p in self._metrics_ports.items()}
        extra: dict[str, dict[str, str]] = {
            "gateway": {"FLOTILLA_HOST": opts.host, "FLOTILLA_PORT": str(port),
                        **({"FLOTILLA_UI": "1"} if opts.ui else {}),
                        **({"FLOTILLA_API_KEYS": opts.api_keys} if opts.api_keys else {})},
            "tokenizer": {"FLOTILLA_MODEL": str(model_path), "FLOTILLA_SERVED_MODEL_NAME": model},
            "engine": {"FLOTILLA_MODEL": str(model_path), "FLOTILLA_SERVED_MODEL_NAME": model,
                       **({"FLOTILLA_TP": str(opts.tp)} if opts.tp else {}),
                       **({"FLOTILLA_DEVICE_IDS": opts.device_ids} if opts.device_ids else {}),
                       **({"FLOTILLA_ISQ": opts.isq} if opts.isq else {}),
                       **({"FLOTILLA_KV_CACHE_DTYPE": "fp8"} if opts.fp8_kvcache else {}),
                       **opts.moe_offload},
            "tools": ({"FLOTILLA_MCP_CONFIG": str(Path(opts.mcp_config).resolve())}
                      if opts.mcp_config else {}),
        }
        specs = []
        for name in SERVICES:
            spec = service_spec(name, {**common, **extra[name], **metrics.get(name, {})})
            if name in opts.commands:
                spec = ChildSpec(name, opts.commands[name], spec.env)
            specs.append(spec)
        return specs

    # ------------------------------------------------------------------ readiness

    def pids(self) -> dict[str, int | None]:
        pids: dict[str, int | None] = {"nats-server": None}
        for sup in self._supervisors():
            pids.update(sup.pids())
        return pids

    def restarts(self) -> dict[str, int]:
        return {name: n for sup in self._supervisors() for name, n in sup.restarts().items()}

    def dead(self) -> dict[str, int]:
        return {name: code for sup in self._supervisors() for name, code in sup.dead().items()}

    def _children_changed(self) -> None:
        self._changed_at = time.monotonic()
        self.write_state()

    def _check_alive(self) -> None:
        """While starting: a stop request or a dead child ends the start."""
        if self.stop_requested:
            raise StopRequested("stopped while starting")
        for sup in self._supervisors():
            for name, code in sup.dead().items():
                child = sup.children[name]
                raise SuiteError(f"{name} exited with code {code} while starting; last lines "
                                 f"of {child.log_path}:\n{child.tail(30).rstrip()}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            verdict = self.verdict()
            self._record(verdict)
            if verdict.ready:
                return
            if time.monotonic() > deadline:
                raise SuiteError(f"not ready after {timeout_s:g}s: "
                                 + "; ".join(verdict.reasons))
            time.sleep(0.1)

    def verdict(self) -> Verdict:
        """Ready or not, and why, as of now (never waits for a check)."""
        now = time.monotonic()
        dead = self.dead()
        if dead:
            return Verdict(tuple(f"{name} exited (code {code}); restarting"
                                 for name, code in sorted(dead.items())), now)
        latest = self.prober.latest if self.prober else None
        if latest is None:
            return Verdict(("checking readiness",), now)
        if latest.started <= self._changed_at:  # began before the latest death or restart
            if self.state is not None and not self.state.ready and self.state.reasons:
                return Verdict(tuple(self.state.reasons), now)
            return Verdict(("a service restarted; checking readiness",), now)
        return latest

    def _record(self, verdict: Verdict) -> None:
        """Keep the state file and the console in step with the verdict."""
        assert self.state is not None
        reasons = list(verdict.reasons)
        if verdict.ready != self.state.ready or reasons != self.state.reasons:
            self.state.ready, self.state.reasons = verdict.ready, reasons
            self.write_state()
        now = time.monotonic()
        # while starting, waiting is expected (info); once serving, not ready is news (warning)
        level, label = ((logging.WARNING, "not ready") if self.state.serving
                        else (logging.INFO, "waiting"))
        if reasons != self._said:
            if reasons:
                log.log(level, "%s: %s", label, "; ".join(reasons))
            elif self._said and self.state.serving:
                log.info("ready again")
            self._said, self._said_at = reasons, now
        elif reasons and now - self._said_at >= self.options.remind_s:
            log.log(level, "still %s: %s", label, "; ".join(reasons))
            self._said_at = now

    def write_state(self) -> None:
        if self.state is None or self.state_file is None or not self._lock or \
                not self._lock.held:
            return
        self.state.pids = self.pids()
        self.state.restarts = self.restarts()
        self.state.write(self.state_file)

    def poll(self) -> None:
        """Restart dead children and keep readiness in the state file and the console true.
        Call every few hundred ms from the thread that started the suite (children die with
        the thread that spawned them)."""
        if self.supervisor is None or self.state is None:
            return
        for sup in self._supervisors():
            sup.poll()
        restarts = self.restarts()
        if self.dead() or restarts != self._restarts:
            self._changed_at = time.monotonic()
            self._restarts = restarts
        self._record(self.verdict())

    def serve_forever(self, interval_s: float = 0.2) -> None:
        while not self.stop_requested:
            self.poll()
            time.sleep(interval_s)

    def stop(self) -> None:
        """Stop the checks, the services, then our NATS; remove our state file (only ours)."""
        if self.prober is not None:
            self.prober.stop()
            self.prober = None
        grace = self.options.stop_grace_s
        if grace is None:
            grace = self.options.drain_timeout_s + 5.0
        if self.supervisor is not None:
            self.supervisor.stop(grace)  # SIGTERM: each service drains first
        if self.infra is not None:
            self.infra.stop(grace)
        if self.nats is not None:
            self.nats.remove_store()
        if self._lock is not None and self._lock.held:
            if self.state_file is not None:
                self.state_file.unlink(missing_ok=True)
            self._lock.release()
        self.state = None

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def start_suite(options: SuiteOptions) -> Suite:
    """Start everything and wait until it is ready; raises SuiteError (with the failing child's
    log) if it cannot, leaving nothing running."""
    return Suite(options).start()

