"""EngineSettings → EngineConfig (services/engine/factory.py): every setting reaches the Engine,
its kernel selection, or the service, so a new setting cannot be dropped on the way."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flotilla.kernels.selection import KernelSelection
from flotilla.libs.common.settings import EngineSettings
from flotilla.services.engine.factory import (
    CONFIG_FIELDS,
    KERNEL_FIELDS,
    SERVICE_FIELDS,
    engine_config,
)


def test_every_engine_setting_has_an_owner() -> None:
    unowned = set(EngineSettings.model_fields) - CONFIG_FIELDS - KERNEL_FIELDS - SERVICE_FIELDS
    assert not unowned, f"settings no part of the engine reads: {sorted(unowned)}"


def test_settings_from_the_environment_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"FLOTILLA_MAX_MODEL_LEN": "1024", "FLOTILLA_BLOCK_SIZE": "32",
                        "FLOTILLA_QUANTIZATION": "none", "FLOTILLA_DEVICE_IDS": "2,3",
                        "FLOTILLA_MAX_NUM_BATCHED_TOKENS": "4096", "FLOTILLA_PDL": "0",
                        "FLOTILLA_KERNELS": "torch", "FLOTILLA_PREFILL_TILE": "64,32,4,2",
                        "FLOTILLA_GEMV": "cublas"}.items():
        monkeypatch.setenv(name, value)
    config = engine_config(EngineSettings(device="cpu"), Path("/models/m"))
    assert (config.model, config.max_model_len, config.block_size) == ("/models/m", 1024, 32)
    assert (config.quantization, config.device_ids) == (None, (2, 3))
    assert config.max_num_batched_tokens == 4096
    assert config.kernel_selection == KernelSelection(kernels="torch", pdl="0", gemv="cublas",
                                                      prefill_tile=(64, 32, 4, 2))


def test_bad_kernel_switches_are_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_DENSE_PREFILL", "yes")
    with pytest.raises(ValueError, match="dense_prefill"):
        EngineSettings()
    with pytest.raises(ValueError, match="pdl"):
        KernelSelection(pdl="2")  # type: ignore[arg-type]


def test_the_library_uses_the_servers_defaults(smollm2_path: Path) -> None:
    """LLM() (the library API) builds the engine service's EngineConfig: every field, not only
    the weights (on CPU the weight-only quantization `auto` picks, not the checkpoint's floats)
    and threads, is what the service derives from its settings' defaults."""
    from flotilla.services.engine.llm import LLM

    llm = LLM("default", device="cpu", kvcache_mem_mib=16)
    server = engine_config(EngineSettings(device="cpu", kvcache_mem_mib=16), smollm2_path)
    assert server.resolved_quantization is not None
    assert llm.engine.config.resolved_quantization == server.resolved_quantization
    mine, theirs = dataclasses.asdict(llm.engine.config), dataclasses.asdict(server)
    assert {k: v for k, v in mine.items() if v != theirs[k]} == {}
