"""Why one request ended in error inside the engine, in terms the service can send its client.

Rules:
- A `RequestError` fails one request, never the engine: the step that meets it finishes that
  request with finish reason "error" and carries the error in its RequestOutput; every other
  request goes on. Only the model forward itself (and the executor under it) fails the pod.
- `status` is the HTTP status the gateway answers with: 400 when the request's own input caused
  it (its parameters, its grammar), 500 for a fault of ours, 503 when it may be retried, 504 for
  a passed deadline. `type` / `code` follow OpenAI's error envelope.
- `of(exc)` classifies anything raised by per-request code: a RequestError as it is; a
  ValueError / OverflowError (a parameter the engine could not use) as a 400; anything else
  as a 500.
"""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A sampling parameter the engine cannot use; `param` names it (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class RequestError(Exception):
    def __init__(self, message: str, status: int = 500, type: str = "server_error",
                 code: str | None = None, retry_after_s: float | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.code = message, status, type, code
        self.retry_after_s, self.param = retry_after_s, param

    @classmethod
    def of(cls, exc: BaseException, what: str = "sampling") -> RequestError:
        """`exc` raised by this request's `what` step (sampling, its grammar, logprobs, ...)."""
        if isinstance(exc, RequestError):
            return exc
        detail = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ValueError | OverflowError):
            return cls(f"{what} failed for this request's parameters ({detail})", 400,
                       "invalid_request_error", "invalid_sampling_parameters",
                       param=getattr(exc, "param", None))
        return cls(f"{what} failed for this request ({detail})", 500, "server_error",
                   "request_failed")

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.code!r}, {self.message!r})"
