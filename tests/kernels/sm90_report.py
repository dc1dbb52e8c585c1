"""Run a compile-for-sm_90 report module (tests/*/sm90_compile.py and friends) in a subprocess.

The interpreter never runs Triton's compiler; these modules build real cubins with the ptxas
Triton ships, which needs the JIT decorators, so they run without TRITON_INTERPRET in a process
of their own and print one JSON object as their last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]
needs_ptxas = pytest.mark.skipif(not PTXAS.exists(), reason="triton's bundled ptxas not found")


def sm90_report(module: str, *args: str, timeout: float = 900) -> Any:
    """The JSON report `python -m <module> <args>` prints last (asserting it exits cleanly)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
