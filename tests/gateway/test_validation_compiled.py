"""Request validation with the compiled validator (jsonschema_rs) in front of the reference
(jsonschema): every body gets the verdict, message and `param` the reference alone gives."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flotilla.libs.common.errors import FlotillaError
from flotilla.services.gateway.spec import Spec
from tests.gateway.test_compat_errors import BAD_COMPAT_CHAT, BAD_COMPAT_COMPLETIONS, USER
from tests.gateway.test_http import BAD_CHAT, BAD_COMPLETIONS
from tests.gateway.test_spec import GOOD_CHAT, GOOD_CHAT_EXTENDED, GOOD_COMPLETIONS

pytest.importorskip("jsonschema_rs")

CHAT_BODIES = (GOOD_CHAT + GOOD_CHAT_EXTENDED
               + [body for _, body, *_ in BAD_CHAT if isinstance(body, dict)]
               + [{"model": "m", "messages": USER, **extra} for _, extra, *_ in BAD_COMPAT_CHAT])
COMPLETION_BODIES = GOOD_COMPLETIONS + [{"model": "m", "prompt": "x", **extra}
                                        for _, extra, *_ in BAD_COMPLETIONS
                                        + BAD_COMPAT_COMPLETIONS]
PARAMS = ["model", "messages", "prompt", "n", "seed", "stop", "stream", "stream_options",
          "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens",
          "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "echo",
          "chat_template_kwargs", "ignore_eos", "user", "best_of", "not_a_parameter",
          "logit_bias", "functions", "function_call", "structured_outputs", "guided_choice",
          "n_predict", "verbosity", "modalities", "prediction", "metadata", "suffix"]
MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "audio",
                "parsed", "function_call", "refusal", "id"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats() | st.sampled_from(["", "x", "user", "assistant", "tool", "text", "auto",
                                     "json_schema", "function", "a b", "é" * 70]),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(MESSAGE_KEYS + ["type", "function", "schema", "text",
                                                      "include_usage", "arguments"]),
                      inner, max_size=3),
    max_leaves=8)


@pytest.fixture(scope="module")
def specs() -> tuple[Spec, Spec]:
    return Spec.load(), Spec.load(compiled=False)


def outcome(spec: Spec, operation: str, body: Any) -> tuple[str, str | None] | None:
    """None when accepted, else the error's (message, param)."""
    try:
        spec.validate(operation, body)
    except FlotillaError as exc:
        assert exc.status == 400
        return exc.info.message, exc.info.param
    return None


def test_the_compiled_validator_is_in_use(specs: tuple[Spec, Spec]) -> None:
    compiled, reference = specs
    assert compiled.compiled and not reference.compiled


@pytest.mark.parametrize("operation,body", [("createChatCompletion", b) for b in CHAT_BODIES]
                         + [("createCompletion", b) for b in COMPLETION_BODIES])
def test_table_bodies_get_the_reference_outcome(specs: tuple[Spec, Spec], operation: str,
                                                body: dict[str, Any]) -> None:
    compiled, reference = specs
    assert outcome(compiled, operation, body) == outcome(reference, operation, body)


@pytest.mark.parametrize("value", [math.nan, math.inf, 2**70, -2**64])
def test_values_the_compiled_validator_cannot_take_go_to_the_reference(
        specs: tuple[Spec, Spec], value: Any) -> None:
    compiled, reference = specs
    for param in ("temperature", "seed", "n"):
        body = {**GOOD_CHAT[0], param: value}
        assert outcome(compiled, "createChatCompletion", body) == \
            outcome(reference, "createChatCompletion", body)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=st.booleans(), which=st.integers(min_value=0), param=st.sampled_from(PARAMS),
       in_message=st.booleans(), message_key=st.sampled_from(MESSAGE_KEYS), value=json_values)
def test_mutated_bodies_get_the_reference_outcome(specs: tuple[Spec, Spec], chat: bool,
                                                  which: int, param: str, in_message: bool,
                                                  message_key: str, value: Any) -> None:
    compiled, reference = specs
    bodies = CHAT_BODIES if chat else COMPLETION_BODIES
    body = copy.deepcopy(bodies[which % len(bodies)])
    if in_message and isinstance(body.get("messages"), list) and body["messages"]:
        body["messages"][0][message_key] = value
    else:
        body[param] = value
    body = json.loads(json.dumps(body))  # as parsed from the wire (NaN and big ints included)
    operation = "createChatCompletion" if chat else "createCompletion"
    assert outcome(compiled, operation, body) == outcome(reference, operation, body)
