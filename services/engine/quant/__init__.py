"""Quantization strategies, selected by name (`--quantization`), never by model code."""

from __future__ import annotations

from services.engine.quant.base import (
    QuantConfig,
    QuantMethod,
    UnquantizedConfig,
    UnquantizedLinearMethod,
    get_quant_method,
)
from services.engine.quant.int8 import Int8WeightOnlyConfig, Int8WeightOnlyMethod

QUANT_CONFIGS: dict[str, type[QuantConfig]] = {
    "none": UnquantizedConfig,
    "int8": Int8WeightOnlyConfig,
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


__all__ = ["QUANT_CONFIGS", "Int8WeightOnlyConfig", "Int8WeightOnlyMethod", "QuantConfig",
           "QuantMethod", "UnquantizedConfig", "UnquantizedLinearMethod", "get_quant_config",
           "get_quant_method"]
