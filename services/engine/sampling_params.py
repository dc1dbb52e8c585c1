"""How one request turns logits into tokens, and when it stops.

Rules:
- `temperature == 0` means greedy: the token is the exact argmax of the (processed) logits and
  top-k / top-p / min-p / seed are ignored. A temperature below GREEDY_BELOW (1e-5) is greedy
  too: dividing logits by it overflows float32.
- `top_k` of 0 or -1 disables top-k (a top_k above the vocabulary keeps it all); `top_p == 1`
  and `min_p == 0` disable those filters.
- `seed` (a signed 64-bit integer, OpenAI's range) makes the request reproducible on its own:
  its random stream belongs to the request, so the tokens do not depend on which other requests
  share the batch.
- `max_tokens=None` generates until a stop condition or the model's context length.
- Penalties follow OpenAI (presence / frequency, over generated tokens) and HF / CTRL (repetition,
  over prompt and generated tokens).
- `logit_bias` (token id -> value in [-100, 100]) is added to the logits before anything else;
  `min_tokens` holds back the stop tokens (eos unless `ignore_eos`, and `stop_token_ids`) until
  that many tokens were generated.
- `logprobs=n` returns the sampled token's log-probability plus the n most likely tokens
  (n == 0: only the sampled token), all from the model's unmodified distribution.
  `prompt_logprobs=k` returns, once, the log-probability of every prompt token after the first
  with the k most likely alternatives; such a request computes its whole prompt (no prefix-cache
  hit: cached positions have no logits).
- `guided` (structured.py) constrains the tokens to a grammar; it is per-request state, never
  shared between requests.
- Every value is checked here (ValueError naming the parameter); `check_vocab` adds the checks
  that need the model's vocabulary size. The engine relies on them: nothing a request can set
  may raise inside a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flotilla.services.engine.request_error import InvalidParameter

if TYPE_CHECKING:
    from flotilla.services.engine.structured import GuidedRequest

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**63)  # [low, high): what a torch.Generator and OpenAI's spec accept


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
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    guided: GuidedRequest | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _require(math.isfinite(getattr(self, name)), name,
                     f"must be a finite number, got {getattr(self, name)}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed",
                 f"must be in [-2^63, 2^63), got {self.seed}")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
                 f"must be >= 1, got {self.max_tokens}")
        _require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _require(self.repetition_penalty > 0.0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            _require(n is None or 0 <= n <= MAX_LOGPROBS, name,
                     f"must be in [0, {MAX_LOGPROBS}], got {n}")
        _require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be non-negative token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        for token, bias in self.logit_bias.items():
            _require(token >= 0, "logit_bias", f"has a negative token id ({token})")
            _require(-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",  # NaN fails too
                     f"values must be in [-{MAX_LOGIT_BIAS:g}, "
                     f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token}")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model's vocabulary: every token id names a token."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias)):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise InvalidParameter(name, f"{name}: token id {bad} is outside the "
                                             f"vocabulary [0, {vocab_size})")

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

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature and the filters touches its logits (penalties,
        logit_bias, min_tokens, a grammar): the sampler's per-row work."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or self.guided is not None)


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, f"{param} {message}")
