"""Which implementation serves each op where there is a choice: one frozen object per engine.

Rules:
- `KernelSelection` holds every kernel switch. The engine builds it once from its settings
  (services/engine/factory.py from libs/common/settings.py EngineSettings, environment names
  FLOTILLA_KERNELS, ...; see docs/configuration.md) into `EngineConfig.kernel_selection`, which
  every tensor-parallel rank receives inside its config. Nothing in kernels/ or the layers reads
  the environment, and this module holds no state: two engines in one process keep their own.
- The model loader hands it to the model's `Selecting` parts (layers, quantization methods;
  services/engine/loader `bind_selection`) before the weights load; they keep it, as they keep
  their quantization method, and pass the field each kernel needs as an explicit argument
  (kernels/__init__.py's ops take the whole selection). Parts never bound, and ops called
  without one, use `DEFAULT_SELECTION` (the same choices as a server started without settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tile = tuple[int, int, int, int]


@dataclass(frozen=True)
class KernelSelection:
    # "torch": the torch references serve even on CUDA (debugging, kernels/__init__.py)
    kernels: Literal["auto", "torch"] = "auto"
    # quantized layers: auto (Triton kernels on CUDA, torch on CPU) | triton (also on CPU,
    # under TRITON_INTERPRET) | torch (services/engine/quant/base.py)
    quant_kernels: Literal["auto", "triton", "torch"] = "auto"
    # unquantized decode GEMVs on CUDA: auto | cublas | triton (services/engine/quant/base.py)
    gemv: Literal["auto", "cublas", "triton"] = "auto"
    # fp8 decode GEMV: auto | fma (CUDA cores) | mma (tensor cores) (kernels/fp8.py)
    fp8_gemv: Literal["auto", "fma", "mma"] = "auto"
    # fused gate/up GEMM with the SiLU·mul epilogue: auto (Hopper+, prefill sizes) | 0 | 1
    gated_gemm: Literal["auto", "0", "1"] = "auto"
    # cuDNN fused attention for long uncached prompts: auto (Hopper+) | 0 | 1
    # (kernels/dense_attention.py)
    dense_prefill: Literal["auto", "0", "1"] = "auto"
    # programmatic dependent launch: auto / 1 (compute capability 9.0+) | 0 (kernels/pdl.py)
    pdl: Literal["auto", "0", "1"] = "auto"
    # MLA attention: torch (the absorbed form in torch) | triton (kernels/mla_attention.py)
    mla_kernel: Literal["torch", "triton"] = "torch"
    # GPTQ/AWQ weights on CUDA (services/engine/quant/w4a16.py): kmajor (K-order words: the
    # fastest batch-1 GEMV) | marlin (kernels/w4a16_marlin.py's re-packed words: the faster
    # batched-decode GEMM, a slower GEMV) | both (each copy where it is faster, twice the
    # 4-bit weights' memory)
    w4_layout: Literal["kmajor", "marlin", "both"] = "kmajor"
    # prefill attention tile (block_m, block_n, num_warps, num_stages); None: the tuned
    # defaults (kernels/prefill_attention.py; benchmark sweeps)
    prefill_tile: Tile | None = None

    def __post_init__(self) -> None:
        choices = {"kernels": ("auto", "torch"), "quant_kernels": ("auto", "triton", "torch"),
                   "gemv": ("auto", "cublas", "triton"), "fp8_gemv": ("auto", "fma", "mma"),
                   "gated_gemm": ("auto", "0", "1"), "dense_prefill": ("auto", "0", "1"),
                   "pdl": ("auto", "0", "1"), "mla_kernel": ("torch", "triton"),
                   "w4_layout": ("kmajor", "marlin", "both")}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.prefill_tile is not None and (
                len(self.prefill_tile) != 4 or min(self.prefill_tile) < 1):
            raise ValueError("prefill_tile must be four positive ints: block_m, block_n, "
                             f"num_warps, num_stages; got {self.prefill_tile!r}")


def parse_tile(text: str | None) -> Tile | None:
    """'block_m,block_n,num_warps,num_stages' (the FLOTILLA_PREFILL_TILE spelling) → a tile."""
    if not text:
        return None
    parts = tuple(int(x) for x in text.split(",") if x.strip())
    if len(parts) != 4:
        raise ValueError(f"a prefill tile is 'block_m,block_n,num_warps,num_stages', got {text!r}")
    return parts[0], parts[1], parts[2], parts[3]


DEFAULT_SELECTION = KernelSelection()


class Selecting:
    """A part that dispatches between implementations: it keeps the selection it was given
    (`selection`, bound by the model loader), or the defaults until then."""

    selection: KernelSelection = DEFAULT_SELECTION
