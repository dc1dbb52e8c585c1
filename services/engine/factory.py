"""Builds an Engine from EngineSettings.

Rules:
- `engine_config` derives EngineConfig from the settings in one step: every field the two share
  is taken as it is (its name is the contract), the kernel switches become the frozen
  KernelSelection (kernels/selection.py), and the few values the engine spells differently are
  converted in `_CONVERTED`. Settings the service itself uses (admission, grammars, discovery)
  are named in SERVICE_FIELDS; tests/engine/test_factory.py checks that every setting lands
  somewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flotilla.kernels.selection import KernelSelection, parse_tile
from flotilla.libs.common.settings import CommonSettings, EngineSettings
from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.engine import Engine

CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
KERNEL_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelSelection))
# read by the engine service (service.py, admission.py, structured.py), not by the Engine
SERVICE_FIELDS = frozenset(CommonSettings.model_fields) | {
    "served_model_name", "engine_id", "admit_window_ms", "admit_window_max_ms",
    "max_waiting_requests", "max_waiting_tokens", "grammar_cache_entries", "grammar_cache_mib",
    "grammar_compile_workers", "grammar_max_pending", "grammar_compile_timeout_s", "step_log"}
_CONVERTED: dict[str, Callable[[Any], Any]] = {
    "max_num_batched_tokens": lambda v: v or 0,  # EngineConfig: 0 = its default budget
    "quantization": lambda v: None if v == "none" else v,
    "device_ids": lambda v: tuple(int(i) for i in v.split(",")) if v else None,
}


def build_engine(settings: EngineSettings, path: Path) -> Engine:
    return Engine(engine_config(settings, path))


def kernel_selection(settings: EngineSettings) -> KernelSelection:
    values = settings.model_dump(include=set(KERNEL_FIELDS))
    return KernelSelection(**{**values, "prefill_tile": parse_tile(settings.prefill_tile)})


def engine_config(settings: EngineSettings, path: Path) -> EngineConfig:
    values = settings.model_dump(include=set(CONFIG_FIELDS))
    for name, convert in _CONVERTED.items():
        values[name] = convert(values[name])
    values["model"] = str(path)
    return EngineConfig(**values, kernel_selection=kernel_selection(settings))
