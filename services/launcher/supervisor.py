"""Keeps the suite's children alive: restarts a child that dies unexpectedly, with backoff.

Rules:
- `poll()` is called periodically by the owner (the launcher's main loop); it never blocks.
- A child that exits while the supervisor is running is restarted after a backoff that doubles
  with each quick failure (`min_backoff_s` … `max_backoff_s`) and resets once the child has stayed
  up for `stable_after_s`. Every death and restart is logged with the child's last log lines.
- `stop()` ends restarts first, then stops every child (SIGTERM, grace, SIGKILL).
- `on_change` is called after any pid changes, so the state file stays true.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flotilla.services.launcher.processes import Child, ChildSpec, stop_all

log = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    min_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0


@dataclass
class _Slot:
    child: Child
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None  # set while a dead child waits for its restart


class Supervisor:
    def __init__(self, specs: list[ChildSpec], log_dir: Path,
                 policy: RestartPolicy | None = None,
                 on_change: Callable[[], None] | None = None):
        self.policy = policy or RestartPolicy()
        self.log_dir = log_dir
        self.on_change = on_change or (lambda: None)
        self._slots = {s.name: _Slot(Child(s, log_dir / f"{s.name}.log")) for s in specs}
        self._stopping = False

    @property
    def children(self) -> dict[str, Child]:
        return {name: slot.child for name, slot in self._slots.items()}

    def pids(self) -> dict[str, int | None]:
        return {name: slot.child.pid for name, slot in self._slots.items()}

    def restarts(self) -> dict[str, int]:
        return {name: slot.restarts for name, slot in self._slots.items()}

    def start(self) -> None:
        for slot in self._slots.values():
            slot.child.start()
            slot.backoff_s = self.policy.min_backoff_s
        self.on_change()

    def dead(self) -> dict[str, int]:
        """Children that have exited (name → exit code), without restarting them."""
        return {name: code for name, slot in self._slots.items()
                if (code := slot.child.poll()) is not None}

    def poll(self) -> None:
        """Restart dead children whose backoff has elapsed; schedule restarts for new deaths."""
        if self._stopping:
            return
        now = time.monotonic()
        changed = False
        for name, slot in self._slots.items():
            child = slot.child
            code = child.poll()
            if code is None:
                if now - child.started_at >= self.policy.stable_after_s:
                    slot.backoff_s = self.policy.min_backoff_s
                continue
            if slot.restart_at is None:
                slot.restart_at = now + slot.backoff_s
                log.error("%s (pid %s) exited with code %s; restarting in %.1fs. Last lines of "
                          "%s:\n%s", name, child.pid, code, slot.backoff_s, child.log_path,
                          child.tail(20).rstrip())
            elif now >= slot.restart_at:
                slot.restart_at = None
                slot.restarts += 1
                slot.backoff_s = min(slot.backoff_s * 2, self.policy.max_backoff_s)
                child.start()
                log.warning("restarted %s (pid %s, restart #%d)", name, child.pid, slot.restarts)
                changed = True
        if changed:
            self.on_change()

    def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        stop_all([slot.child for slot in self._slots.values()], grace_s)
