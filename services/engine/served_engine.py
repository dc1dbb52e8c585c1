"""`ServedEngine`: what the engine service (service.py) needs from an engine, as a Protocol."""

from __future__ import annotations

from typing import Protocol

from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.loop import SteppedEngine
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.pool_service import PoolingEngine


class ServedEngine(SteppedEngine, PoolingEngine, Protocol):
    """What the engine service needs from an engine beyond the step loop's part and pooling
    admission's (pool_service.py): `Engine` (engine.py) is one. Its `executor` reports a failed
    tensor-parallel rank; `shutdown` stops the workers; `max_model_len` is published in its
    announcements."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def model_config(self) -> ModelConfig:
        """The checkpoint's config (a GGUF's pooling type says what the model is for)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def shutdown(self) -> None: ...
