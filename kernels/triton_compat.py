"""Triton when it is installed, else a stand-in that keeps kernels/ importable.

Rules:
- Every module of kernels/ takes `triton`, `tl` (triton.language) and `TensorDescriptor` from
  here, never from triton itself. Triton is only needed on GPU machines: the CPU build of torch
  does not bring it, and flotilla lists it in its `gpu` extra (`pip install 'flotilla[gpu]'`;
  torch's CUDA wheels from PyPI require it themselves).
- Without Triton (`HAVE_TRITON` False) the stand-in provides what the modules use while they are
  imported: `triton.jit` (bare or with options), `autotune`, `heuristics`, `Config`, `cdiv`,
  `next_power_of_2`, `tl.constexpr`, and a placeholder for any other `tl` name (dtypes in default
  arguments, `tl.math`). A kernel it decorated raises `TritonMissingError` when it is launched;
  so does any other use of the stand-in at run time.
- Dispatch never picks a Triton kernel without Triton (kernels.use_triton, the quantized layers'
  use_kernels), and an engine asked to run on CUDA, or to force the kernels on CPU, refuses to
  start (`require_triton`, from EngineConfig).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

_IMPORT_ERROR = ""  # why `import triton` failed, for the error message
INSTALL_HINT = ("pip install 'flotilla[gpu]' (torch's CUDA wheels from PyPI bring it too; the CPU "
                "build of torch does not)")


class TritonMissingError(ImportError):
    """A Triton kernel (or another Triton API) was used and Triton is not installed."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} needs Triton, which is not installed ({_IMPORT_ERROR}): "
                         f"{INSTALL_HINT}", name="triton")


def require_triton(what: str) -> None:
    """Raise TritonMissingError naming `what` unless Triton is installed."""
    if not HAVE_TRITON:
        raise TritonMissingError(what)


class _MissingKernel:
    """What `triton.jit` (and `autotune` / `heuristics` over it) makes without Triton."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__module__ = getattr(fn, "__module__", __name__)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.__call__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonMissingError(f"the Triton kernel {self.__module__}.{self.__name__}")

    def __repr__(self) -> str:
        return f"<Triton kernel {self.__name__} (Triton not installed)>"


class _Missing:
    """Any other `tl.*` / `triton.*` name: importable, unusable."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonMissingError(self._name)

    def __repr__(self) -> str:
        return f"<{self._name} (Triton not installed)>"


def _jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """`@triton.jit` and `@triton.jit(do_not_specialize=...)`."""
    if fn is None:
        return _MissingKernel
    return _MissingKernel(fn)


def _decorator(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
    """`@triton.autotune(configs, key=...)`, `@triton.heuristics({...})`: the kernel as it is
    (or wrapped, if it is still a plain function)."""
    return lambda kernel: kernel if isinstance(kernel, _MissingKernel) else _MissingKernel(kernel)


class _Config:
    """triton.Config: kept for the modules' config lists (and their pruning helpers)."""

    def __init__(self, kwargs: dict[str, Any], num_warps: int = 4, num_stages: int = 3,
                 num_ctas: int = 1, maxnreg: int | None = None,
                 pre_hook: Callable[..., Any] | None = None, **rest: Any) -> None:
        self.kwargs = dict(kwargs)
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.num_ctas = num_ctas
        self.maxnreg = maxnreg
        self.pre_hook = pre_hook
        self.__dict__.update(rest)

    def all_kwargs(self) -> dict[str, Any]:
        return {**self.kwargs, "num_warps": self.num_warps, "num_stages": self.num_stages,
                "num_ctas": self.num_ctas, "maxnreg": self.maxnreg}

    def __repr__(self) -> str:
        return f"Config({self.all_kwargs()})"


class _Constexpr:
    """tl.constexpr: an annotation, and a module-level constant's box (`.value`)."""

    def __init__(self, value: Any = None) -> None:
        self.value: Any = value.value if isinstance(value, _Constexpr) else value

    def __repr__(self) -> str:
        return f"constexpr[{self.value!r}]"


def _cdiv(x: int, div: int) -> int:
    return (x + div - 1) // div


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class _StandInModule(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


def _stand_in() -> tuple[ModuleType, ModuleType, Any]:
    language = _StandInModule("triton.language")
    language.constexpr = _Constexpr  # type: ignore[attr-defined]
    language.cdiv = _cdiv  # type: ignore[attr-defined]
    module = _StandInModule("triton")
    module.language = language  # type: ignore[attr-defined]
    module.jit = _jit  # type: ignore[attr-defined]
    module.autotune = _decorator  # type: ignore[attr-defined]
    module.heuristics = _decorator  # type: ignore[attr-defined]
    module.Config = _Config  # type: ignore[attr-defined]
    module.cdiv = _cdiv  # type: ignore[attr-defined]
    module.next_power_of_2 = _next_power_of_2  # type: ignore[attr-defined]
    module.testing = SimpleNamespace(  # type: ignore[attr-defined]
        do_bench=_Missing("triton.testing.do_bench"))
    return module, language, _Missing("triton.tools.tensor_descriptor.TensorDescriptor")


if TYPE_CHECKING:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAVE_TRITON: bool
else:
    try:
        import triton
        import triton.language as tl
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError as exc:
        HAVE_TRITON = False
        _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        triton, tl, TensorDescriptor = _stand_in()
    else:
        HAVE_TRITON = True

__all__ = ["HAVE_TRITON", "INSTALL_HINT", "TensorDescriptor", "TritonMissingError",
           "require_triton", "tl", "triton"]
