"""What one keyed request has used: its admission, its token reservation and its real tokens.

Rules:
- `ApiKeyAuth` (auth.py) makes a `KeyUsage` for each authenticated request and makes it the
  request's `CURRENT` for the request's task and the tasks it starts (a stream's body runs in
  one): `read_json` (request_body.py) checks the key's model allowlist and reserves tokens through
  it; `ChoiceStreams` (streams.py) reports each choice's admission and final usage to it.
- Tokens reserved on admission are the body's characters / 4 (OpenAI's rule of thumb for the
  prompt) plus, per choice, `max_tokens` (or its aliases) else `key_reserve_output_tokens`.
- The real count is the finals' prompt + completion tokens. A request some choice of which
  ended without a final (a client that left, a failed stream) is charged at least its
  reservation: the tokens it made before it ended are not known here.
- The x-ratelimit-* headers describe the limits the key has (none for an unlimited one), with
  OpenAI's names; `reset` is a duration ("45s", "1m30s", "250ms").
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import ErrorInfo, Usage
from flotilla.services.gateway.api_keys import KeyRecord
from flotilla.services.gateway.rate_limits import Limiter, Verdict

CURRENT: ContextVar[KeyUsage | None] = ContextVar("flotilla_key_usage", default=None)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages",
                              "/v1/responses"})
CHARS_PER_TOKEN = 4


def duration(ms: int) -> str:
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, seconds = divmod(ms / 1000, 60)
    text = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def rate_limited(kind: str, message: str, retry_ms: int) -> FlotillaError:
    """429 in OpenAI's shape: `type` is `requests` or `tokens`."""
    return FlotillaError(ErrorInfo(status=429, type=kind, code="rate_limit_exceeded",
                                   message=message, retry_after_s=max(retry_ms, 1) / 1000))


def model_not_allowed(model: str) -> FlotillaError:
    """A model outside the key's allowlist answers as OpenAI does for a model the key cannot
    see: 404 `model_not_found` (it does not reveal that the model is served)."""
    return FlotillaError(ErrorInfo(
        status=404, type="invalid_request_error", param="model", code="model_not_found",
        message=f"The model `{model}` does not exist or you do not have access to it."))


def output_tokens(body: dict[str, Any], default: int) -> int:
    """Tokens reserved for a request's output: the most it may generate, over its choices."""
    most = next((body[k] for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                 if isinstance(body.get(k), int) and body[k] > 0), default)
    n = body["n"] if isinstance(body.get("n"), int) and body["n"] > 0 else 1
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(
        prompt[0], int) else 1
    return int(most) * int(n) * prompts


@dataclass
class KeyUsage:
    record: KeyRecord
    limiter: Limiter
    lease: str
    admission: Verdict | None = None
    tokens: Verdict | None = None  # the reservation's verdict, once made
    reserved: int = 0
    admitted: int = 0  # choices admitted by a tokenizer
    finished: int = 0  # choices that reported their final usage
    used: int = 0  # their prompt + completion tokens
    unfinished_prompt: int = 0  # prompt tokens of admitted choices not finished yet
    settled: bool = False

    def check_model(self, model: str) -> None:
        if not self.record.allows(model):
            raise model_not_allowed(model)

    async def reserve(self, body: dict[str, Any], body_chars: int, output_default: int) -> None:
        if self.record.tpm is None:
            return
        cost = math.ceil(body_chars / CHARS_PER_TOKEN) + output_tokens(body, output_default)
        self.tokens = await self.limiter.reserve(self.record, cost)
        if self.tokens.refused:
            limit = self.record.tpm
            raise rate_limited("tokens", f"Rate limit reached for tokens per minute (TPM): "
                               f"Limit {limit}, Used {self.tokens.tokens_used}, Requested "
                               f"{cost}." + (" The request is larger than the limit."
                                             if cost > limit else
                                             f" Please try again in "
                                             f"{duration(self.tokens.retry_ms)}."),
                               self.tokens.retry_ms)
        self.reserved = cost

    def choice_admitted(self, prompt_tokens: int) -> None:
        self.admitted += 1
        self.unfinished_prompt += prompt_tokens

    def choice_finished(self, usage: Usage, prompt_tokens: int) -> None:
        self.finished += 1
        self.unfinished_prompt -= prompt_tokens
        self.used += usage.prompt_tokens + usage.completion_tokens

    def actual_tokens(self) -> int:
        if self.finished >= self.admitted:
            return self.used
        return max(self.reserved, self.used + self.unfinished_prompt)

    async def settle(self) -> None:
        """Release the request's slot and settle its tokens (once)."""
        if self.settled:
            return
        self.settled = True
        lease = self.lease if self.record.max_concurrent and self.admission else None
        window, delta = -1, 0
        if self.tokens is not None and not self.tokens.refused:
            window, delta = self.tokens.window, self.actual_tokens() - self.reserved
        if lease is not None or delta:
            await self.limiter.finish(self.record, lease, window, delta)

    def headers(self) -> list[tuple[bytes, bytes]]:
        out: list[tuple[str, str]] = []
        rpm, tpm = self.record.rpm, self.record.tpm
        if rpm and self.admission is not None:
            out += [("x-ratelimit-limit-requests", str(rpm)),
                    ("x-ratelimit-remaining-requests",
                     str(max(0, rpm - self.admission.requests_used))),
                    ("x-ratelimit-reset-requests", duration(self.admission.requests_reset_ms))]
        seen = self.tokens or self.admission
        if tpm and seen is not None:
            out += [("x-ratelimit-limit-tokens", str(tpm)),
                    ("x-ratelimit-remaining-tokens", str(max(0, tpm - seen.tokens_used))),
                    ("x-ratelimit-reset-tokens", duration(seen.tokens_reset_ms))]
        return [(k.encode(), v.encode()) for k, v in out]


async def check_body(path: str, body: Any, body_chars: int, output_default: int) -> None:
    """The checks the request's key makes on its parsed body (see the module rules): its model
    allowlist, and on generation routes the token reservation. Nothing without a key."""
    usage = CURRENT.get()
    if usage is None or not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        usage.check_model(body["model"])
    if path in GENERATION_PATHS:
        await usage.reserve(body, body_chars, output_default)
