"""Suite-wide test set-up.

TRITON_INTERPRET must be set before the first `import triton` anywhere in the process (triton
compiles its own helpers at import), so it is set here, at the root, when no GPU is present: the
Triton kernels then run on CPU tensors under the interpreter.
"""

from __future__ import annotations

import os


def _has_cuda() -> bool:
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
