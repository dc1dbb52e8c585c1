"""The context rule: how many tokens a request may generate, decided the same way everywhere.

The engine owns the context length (`max_model_len`: the smallest of the model's own, the
FLOTILLA_MAX_MODEL_LEN cap and what its KV cache holds) and publishes it in its announcement.
This function is the one place max_tokens is resolved; the engine's admission, `Engine.add_request`
(the library API) and the tokenizer's early check against the published length all call it.

Rules:
- the prompt must leave room for at least one token, else a refusal naming the prompt;
- max_tokens absent (None): all the room that is left;
- max_tokens larger than the room: a refusal naming `max_tokens`, with the real limit;
- the refusal is a `ContextLengthExceeded` (a ValueError), which services answer as a 400 with
  code `context_length_exceeded` (OpenAI's) and the exception's `param`.
"""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """The prompt (with max_tokens, if given) does not fit the context; `param` names what to
    shorten (OpenAI's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def resolve_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                       prompt_param: str = "prompt") -> int:
    """The number of tokens a request of `prompt_tokens` may generate (see module rules);
    `prompt_param` names the prompt in errors ("messages" for a chat)."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{prompt_param} resulted in {prompt_tokens} tokens, which leaves no room for a "
            f"completion. Please reduce the length of the {prompt_param}.", prompt_param)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
            f"{prompt_param}, {max_tokens} in the completion): max_tokens may be at most {room} "
            f"for this {prompt_param}. Please reduce the length of the {prompt_param} or "
            "max_tokens.", "max_tokens")
    return max_tokens
