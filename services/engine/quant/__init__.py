"""Quantization strategies, selected by name (`--quantization` / `--isq`) or by the checkpoint,
never by model code.

- By name: "none", "int8" / "int4" (CPU weight-only), the in-situ names of quant/isq.py
  (q4_0 .. q6k, fp8), "gptq" / "awq" (default layouts: random-weight benchmarks).
- By checkpoint: config.json's `quantization_config` (gptq, awq, fp8, compressed-tensors fp8,
  mxfp4 experts of gpt-oss)
  through `quant_config_from_hf`; GGUF files through quant/gguf.py's GGUFConfig (the loader).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from flotilla.services.engine.quant.awq import AWQConfig
from flotilla.services.engine.quant.base import (
    QuantConfig,
    QuantMethod,
    UnquantizedConfig,
    UnquantizedLinearMethod,
    get_quant_method,
)
from flotilla.services.engine.quant.fp8 import FP8Config
from flotilla.services.engine.quant.gguf import GGUFConfig, GGUFLinearMethod, QuantBytes
from flotilla.services.engine.quant.gptq import GPTQConfig
from flotilla.services.engine.quant.int4 import Int4WeightOnlyConfig, Int4WeightOnlyMethod
from flotilla.services.engine.quant.int8 import Int8WeightOnlyConfig, Int8WeightOnlyMethod
from flotilla.services.engine.quant.isq import ISQ_NAMES, ISQConfig
from flotilla.services.engine.quant.mxfp4 import Mxfp4Config


def _isq(name: str) -> Callable[[], QuantConfig]:
    return lambda: ISQConfig(name)


QUANT_CONFIGS: dict[str, Callable[[], QuantConfig]] = {
    "none": UnquantizedConfig,
    "int8": Int8WeightOnlyConfig,
    "int4": Int4WeightOnlyConfig,
    "gptq": GPTQConfig,
    "awq": AWQConfig,
    **{name: _isq(name) for name in ISQ_NAMES},
}
# quantization_config["quant_method"] -> config reader
HF_QUANT_METHODS: dict[str, Callable[[dict[str, Any], Collection[str]], QuantConfig]] = {
    "gptq": GPTQConfig.from_hf,
    "awq": AWQConfig.from_hf,
    "fp8": FP8Config.from_hf,
    "compressed-tensors": FP8Config.from_hf,
    "mxfp4": Mxfp4Config.from_hf,
}


def get_quant_config(name: str | None) -> QuantConfig | None:
    """Map a quantization name to its config; None or "none" means plain float weights."""
    if name is None or name == "none":
        return None
    try:
        return QUANT_CONFIGS[name]()
    except KeyError:
        raise ValueError(f"unknown quantization {name!r}; supported: "
                         f"{', '.join(sorted(QUANT_CONFIGS))}") from None


def quant_config_from_hf(qcfg: dict[str, Any], tensor_names: Collection[str]) -> QuantConfig:
    """The config of a pre-quantized checkpoint (`quantization_config` of config.json)."""
    method = str(qcfg.get("quant_method", "?")).lower()
    try:
        reader = HF_QUANT_METHODS[method]
    except KeyError:
        raise ValueError(f"pre-quantized checkpoints ({method}) are not supported; supported: "
                         f"{', '.join(sorted(HF_QUANT_METHODS))}") from None
    return reader(qcfg, tensor_names)


__all__ = ["HF_QUANT_METHODS", "ISQ_NAMES", "QUANT_CONFIGS", "AWQConfig", "FP8Config",
           "GGUFConfig", "GGUFLinearMethod", "GPTQConfig", "ISQConfig", "Int4WeightOnlyConfig",
           "Int4WeightOnlyMethod", "Int8WeightOnlyConfig",
           "Int8WeightOnlyMethod", "Mxfp4Config", "QuantBytes", "QuantConfig", "QuantMethod",
           "UnquantizedConfig", "UnquantizedLinearMethod", "get_quant_config",
           "get_quant_method", "quant_config_from_hf"]
