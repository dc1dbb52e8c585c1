"""Suite-wide test set-up.

TRITON_INTERPRET must be set before the first `import triton` anywhere in the process (triton
compiles its own helpers at import), so it is set here, at the root, when no GPU is present: the
Triton kernels then run on CPU tensors under the interpreter.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _has_cuda() -> bool:
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model's GGUF (fetched into the model cache once)."""
    from libs.common.model_cache import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path):  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer, built from its GGUF metadata."""
    from services.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(smollm2_path)


@pytest.fixture
def select_kernels(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Install a kernel selection for this test (kernels/selection.py; the engine installs the
    one its settings give): `select_kernels(quant_kernels="triton")`. Put back afterwards."""
    from kernels import selection

    def select(**switches: object) -> selection.KernelSelection:
        chosen = selection.KernelSelection(**switches)  # type: ignore[arg-type]
        monkeypatch.setattr(selection, "_installed", chosen)
        return chosen

    return select
