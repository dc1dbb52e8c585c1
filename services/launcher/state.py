"""The launcher's state file: where a running suite can be found.

One JSON file per running launcher, rewritten atomically whenever a pid changes:
```json
{"launcher_pid": 1234, "gateway_url": "http://127.0.0.1:8000/v1", "nats_url": "nats://...",
 "model": "SmolLM2-135M-Instruct", "model_path": "/.../x.gguf", "log_dir": "/.../logs",
 "pids": {"nats-server": 1235, "gateway": 1236, ...}, "restarts": {"engine": 0, ...},
 "ready": true}
```
`ready` turns true once every service answers health, false while a dead service is being
restarted, and true again once it answers. Default location:
`$FLOTILLA_RUN_DIR/flotilla-<port>.json`, where FLOTILLA_RUN_DIR defaults to `<tmp>/flotilla-<uid>`.
Tests and operators pass `--state-file` to pick the path.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path


def run_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"flotilla-{os.getuid()}"
    return Path(os.environ.get("FLOTILLA_RUN_DIR") or default)


def default_state_file(port: int) -> Path:
    return run_dir() / f"flotilla-{port}.json"


@dataclass
class SuiteState:
    launcher_pid: int
    gateway_url: str
    nats_url: str
    model: str
    model_path: str
    log_dir: str
    pids: dict[str, int | None] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    ready: bool = False

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)  # readers never see a half-written file

    @classmethod
    def read(cls, path: Path) -> SuiteState:
        return cls(**json.loads(Path(path).read_text()))


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
