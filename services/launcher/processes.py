"""Child processes of the launcher: how they are spawned, logged and ended.

Rules:
- Every child runs in its own session (a terminal Ctrl-C reaches only the launcher, which then
  stops the children in order: SIGTERM, grace, SIGKILL) and asks the kernel to SIGKILL it when
  the launcher dies (PR_SET_PDEATHSIG), so even a SIGKILLed launcher leaves no orphans: SIGKILL,
  because a wedged child could ignore anything gentler and there is no one left to escalate.
  Children must be spawned from the launcher's main thread: the death signal fires when the
  *spawning thread* exits.
- A child's stdout and stderr go to its own log file (appended across restarts); `tail()` reads
  the last lines back for error reports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Runs in the child between fork and exec: die with the parent (the signal survives exec)."""
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


@dataclass(frozen=True)
class ChildSpec:
    """What to run for one service: its argv and the environment on top of the launcher's."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def service_spec(name: str, env: dict[str, str]) -> ChildSpec:
    """A flotilla service run as `python -m flotilla.services.<name>`."""
    return ChildSpec(name, [sys.executable, "-m", f"flotilla.services.{name}"], env)


class Child:
    """One running (or exited) child process and its log file."""

    def __init__(self, spec: ChildSpec, log_path: Path):
        self.spec, self.log_path = spec, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        env = {**os.environ, **self.spec.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"--- {time.strftime('%F %T')} starting {' '.join(self.spec.argv)}\n"
                      .encode())
            out.flush()
            self.proc = subprocess.Popen(self.spec.argv, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=child_preexec, start_new_session=True)
        self.started_at = time.monotonic()

    def poll(self) -> int | None:
        """The exit code, or None while running (or never started)."""
        return self.proc.poll() if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int, group: bool = False) -> None:
        """Signal the child, or with `group` its whole process group (helpers it spawned)."""
        if self.running:
            assert self.proc is not None
            try:
                if group:
                    os.killpg(self.proc.pid, sig)
                else:
                    self.proc.send_signal(sig)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(self, timeout: float) -> bool:
        """Wait for exit; True if it has exited."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError:
            return ""


def stop_all(children: list[Child], grace_s: float) -> None:
    """SIGTERM every child, wait up to `grace_s` in total, then SIGKILL the stragglers."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        child.wait(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.running:
            child.signal(signal.SIGKILL, group=True)
            child.wait(5.0)
