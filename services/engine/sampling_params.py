"""How one request turns logits into tokens, and when it stops.

Rules:
- `temperature == 0` means greedy: the token is the exact argmax of the (penalised) logits and
  top-k / top-p / min-p / seed are ignored.
- `top_k` of 0 or -1 disables top-k; `top_p == 1` and `min_p == 0` disable those filters.
- `seed` makes the request reproducible on its own: its random stream belongs to the request, so
  the tokens do not depend on which other requests share the batch.
- `max_tokens=None` generates until a stop condition or the model's context length.
- Penalties follow OpenAI (presence / frequency, over generated tokens) and HF / CTRL (repetition,
  over prompt and generated tokens).
- `logprobs=n` returns the sampled token's log-probability plus the n most likely tokens
  (n == 0: only the sampled token), all from the model's unmodified distribution.
- `guided` (structured.py) constrains the tokens to a grammar; it is per-request state, never
  shared between requests (`structured.for_engine(engine).request(spec, stop_ids)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.engine.structured import GuidedRequest

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    guided: GuidedRequest | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_top_k_top_p(self) -> bool:
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)
