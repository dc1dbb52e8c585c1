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

# Property tests draw the same examples every run (a CI run is reproducible, and a red CI is a
# real regression, not the day's draw); derandomize=False here explores new examples locally.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("flotilla", derandomize=True, database=None)
_hypothesis_settings.load_profile("flotilla")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model's GGUF (fetched into the model cache once)."""
    from flotilla.libs.common.model_cache import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path):  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer, built from its GGUF metadata."""
    from flotilla.services.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(smollm2_path)


