"""The context length a tokenizer checks requests against, learned from the engines.

Rules:
- The engine owns the context length (the smallest of the model's, FLOTILLA_MAX_MODEL_LEN and
  what its KV cache holds) and publishes it in every announcement (libs/common/context.py).
- The tokenizer's own length (the model's, capped by FLOTILLA_MAX_MODEL_LEN) holds until an
  engine of its model announces; after that the length is the smallest of its own and those of
  the engines heard within `ttl_s` (an engine that stops announcing no longer counts).
"""

from __future__ import annotations

import time

from flotilla.libs.common.messages import Announcement


class EngineContext:
    def __init__(self, model: str, own: int, ttl_s: float) -> None:
        self.model, self.own, self.ttl_s = model, own, ttl_s
        self._engines: dict[str, tuple[int, float]] = {}  # instance → (length, last heard)

    def heard(self, ann: Announcement, now: float | None = None) -> None:
        """Record an engine's announcement (others are ignored)."""
        if ann.service == "engine" and ann.model == self.model and ann.max_model_len:
            self._engines[ann.instance] = (ann.max_model_len,
                                           time.monotonic() if now is None else now)

    def length(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        for instance, (_, seen) in list(self._engines.items()):
            if now - seen > self.ttl_s:
                del self._engines[instance]
        return min([self.own, *(n for n, _ in self._engines.values())])
