"""The launcher's state file: where a running suite can be found, and who owns it.

One JSON file per running launcher, rewritten atomically whenever a pid or the readiness changes:
```json
{"launcher_pid": 1234, "gateway_url": "http://127.0.0.1:8000/v1", "nats_url": "nats://...",
 "nats_private": true, "model": "SmolLM2-135M-Instruct", "model_path": "/.../x.gguf",
 "log_dir": "/.../logs", "pids": {"nats-server": 1235, "gateway": 1236, ...},
 "restarts": {"engine": 0, ...}, "serving": true, "ready": true, "reasons": []}
```
`serving` turns true once the suite first became ready (before that it is starting); `ready`
is the launcher's latest readiness verdict (every child alive and answering, the gateway's
/ready 200) and `reasons` says why not, one line each. Default location:
`$FLOTILLA_RUN_DIR/flotilla-<port>.json`, where FLOTILLA_RUN_DIR defaults to `<tmp>/flotilla-<uid>`.
Tests and operators pass `--state-file` to pick the path.

Ownership: a launcher holds an exclusive lock (`flock` on `<file>.lock`, released by the kernel
when the process dies, however it dies) for as long as it runs, taken before it writes the file
and before it starts anything. A second launcher for the same file fails at once, naming the
first, and a launcher that fails never writes or removes a file it does not own.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path


def run_dir(configured: Path | None = None) -> Path:
    """LauncherSettings.run_dir (FLOTILLA_RUN_DIR), else <temp dir>/flotilla-<uid>."""
    return configured or Path(tempfile.gettempdir()) / f"flotilla-{os.getuid()}"


def default_state_file(port: int, directory: Path | None = None) -> Path:
    return run_dir(directory) / f"flotilla-{port}.json"


@dataclass
class SuiteState:
    launcher_pid: int
    gateway_url: str
    nats_url: str
    model: str
    model_path: str
    log_dir: str
    nats_private: bool = False
    pids: dict[str, int | None] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    serving: bool = False
    ready: bool = False
    reasons: list[str] = field(default_factory=list)
    nats_token_file: str | None = None  # the private nats-server's token (0600), for status
    metrics_urls: dict[str, str] = field(default_factory=dict)  # service -> its /metrics

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)  # readers never see a half-written file

    @classmethod
    def read(cls, path: Path) -> SuiteState:
        return cls(**json.loads(Path(path).read_text()))


class StateFileBusy(RuntimeError):
    """Another live launcher owns this state file."""


class StateFileLock:
    """Exclusive ownership of one state file for this process (see the module notes)."""

    def __init__(self, path: Path):
        self.path = path
        self.lock_path = path.with_name(f".{path.name}.lock")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StateFileBusy(f"another flotilla is running with {self.path}"
                                f"{_owner(self.path)}; stop it first, or pick another "
                                "--port or --state-file") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _owner(path: Path) -> str:
    try:
        state = SuiteState.read(path)
    except (OSError, ValueError, TypeError):
        return ""
    return f" (launcher pid {state.launcher_pid}, serving {state.gateway_url})"


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
