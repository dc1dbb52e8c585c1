"""Shared set-up of the test packages that run Triton kernels (tests/kernels, tests/quant).

Without CUDA the kernels run under the Triton interpreter, which must be switched on before the
first `import triton` of the process (see tests/kernels/conftest.py); importing this module does
that and applies the interpreter fixes. `mark_items` skips GPU-only tests without CUDA, and the
interpreter tests when triton was imported too early for the interpreter to take effect.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

INTERPRETER_TOO_LATE = False
if not torch.cuda.is_available():
    INTERPRETER_TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.kernels import interpreter_fixes

    interpreter_fixes.apply()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mark_items(items: list[pytest.Item], here: str,
               needs_interpreter: Callable[[pytest.Item], bool]) -> None:
    """Add skip markers to the collected items under the folder `here`."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    too_late = pytest.mark.skip(
        reason="triton was imported before TRITON_INTERPRET=1 was set (tests/kernels/conftest.py)"
    )
    for item in items:
        if not str(item.path).startswith(here):
            continue
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        elif INTERPRETER_TOO_LATE and needs_interpreter(item):
            item.add_marker(too_late)
