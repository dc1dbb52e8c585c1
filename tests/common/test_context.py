"""The context rule (libs/common/context.py): one behaviour for the engine, the library API and
the tokenizer's early check."""

from __future__ import annotations

import pytest

from flotilla.libs.common.context import ContextLengthExceeded, resolve_max_tokens


def test_unset_max_tokens_takes_the_room_left() -> None:
    assert resolve_max_tokens(30, None, 100) == 70
    assert resolve_max_tokens(30, 70, 100) == 70
    assert resolve_max_tokens(99, None, 100) == 1


def test_too_many_tokens_are_refused_naming_max_tokens_and_the_limit() -> None:
    with pytest.raises(ContextLengthExceeded) as err:
        resolve_max_tokens(30, 71, 100, "messages")
    assert err.value.param == "max_tokens"
    message = str(err.value)
    assert "maximum context length is 100 tokens" in message
    assert "101 tokens (30 in the messages, 71 in the completion)" in message
    assert "max_tokens may be at most 70" in message


@pytest.mark.parametrize("prompt_tokens", [100, 150])
def test_a_prompt_that_leaves_no_room_is_refused_naming_the_prompt(prompt_tokens: int) -> None:
    for max_tokens in (None, 1):
        with pytest.raises(ContextLengthExceeded) as err:
            resolve_max_tokens(prompt_tokens, max_tokens, 100, "messages")
        assert err.value.param == "messages"
        assert f"resulted in {prompt_tokens} tokens" in str(err.value)
        assert isinstance(err.value, ValueError)  # Engine.add_request's callers catch ValueError
