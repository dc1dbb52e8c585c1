"""schemathesis against the spec the gateway serves, on the real gateway (uvicorn, real NATS, the
fake tokenizer): every operation, positive and negative data, a few hundred examples each.

What must hold for every generated request:
- no server error (5xx), and the status code, content type and body are what the spec says
  (schemathesis' own checks: the spec is the independent contract here);
- positive data is accepted: a 4xx is allowed only for the rules the spec states in prose
  because JSON Schema cannot (`DOCUMENTED_RULES`), answered with a 400 naming that parameter;
- negative data is refused with a 4xx;
- every response body and SSE event we send also validates against the official OpenAI spec.

The served model name is pinned into generated bodies (else nearly every case would be a
correct 404). Examples are derandomized (the same cases every run) and not shrunk, so the
run is bounded in time; `EXAMPLES` sets how many per operation and mode.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import pytest
import requests

from flotilla.services.gateway.service import GatewayService
from tests.anthropic.strict import strict
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_completion_chunk, validate_openai

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = {"POST": 150, "GET": 30}
# The two generation routes get the most; the other POST routes (tokens, Anthropic, Responses,
# which share the chat path behind them) fewer, so the whole run stays within a few minutes.
CORE_PATHS = ("/v1/chat/completions", "/v1/completions")
OTHER_POST_EXAMPLES = 50
# embeddings, score and rerank: one cheap fake vector path behind five routes
POOLING_PATHS = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank")
POOLING_EXAMPLES = 15
# more events than any generated stream sends (choices x chunks; the request timeout bounds it)
MAX_STREAM_EVENTS = 100_000
# Rules the spec states in its descriptions that JSON Schema cannot express (a value checked
# against another field, the model's vocabulary or the server's configuration): a request the
# schema accepts may still get a 400 naming one of these parameters. Each pattern matches a
# whole `param`.
DOCUMENTED_RULES = [
    r"tool_choice(\..+)?",  # names a function that is among the tools
    r"min_tokens",  # at most the completion's maximum
    r"n_predict",  # one bound on the completion's length, not two
    # legacy functions or tools, not both; function_call or tool_choice; with functions, no
    # parallel_tool_calls: true (a legacy reply makes one call)
    r"functions|function_call|parallel_tool_calls",
    # one constraint on the output (response_format / guided_* / structured_outputs.* /
    # grammar / json_schema), and a non-empty structured_outputs; guided_json as JSON text
    r"(grammar|json_schema|guided_\w+|response_format|structured_outputs)(\..+)?",
    r"tools\[\d+\]\.server_label",  # an MCP server this server has
    r"tokens",  # token ids within the model's vocabulary
    # pooling: Matryoshka sizes, vLLM's score pairing, ids within the vocabulary
    r"dimensions|text_1|input",
    # a conversation: not with previous_response_id, room for the request's items, chat n 1
    r"conversation|n",
    # continue the last message or open a new assistant turn, not both
    r"continue_final_message",
    # a background response is polled, not streamed (the spec's CreateResponse says so)
    r"stream",
]
# Anthropic's envelope has no `param`: its documented rule, by message
DOCUMENTED_ANTHROPIC = ("`tool_choice`",)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


def _pin_model(case: Any, model: str) -> None:
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]:
        body["model"] = model  # a non-empty string stays valid: a negative case stays negative
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = model


def _content_type(response: Any) -> str:
    value = response.headers.get("content-type") or ""
    return str(value[0] if isinstance(value, list) else value)


def _documented(error: dict[str, Any]) -> bool:
    param = error.get("param")
    if "param" not in error:  # Anthropic's envelope
        return str(error.get("message", "")).startswith(DOCUMENTED_ANTHROPIC)
    return isinstance(param, str) and any(re.fullmatch(p, param) for p in DOCUMENTED_RULES)


def _without_echo_nulls(body: dict[str, Any]) -> dict[str, Any]:
    """With `echo`, the legacy logprobs start with the prompt's first token, whose logprob and
    top logprobs are null (nothing precedes it): what OpenAI's API and vLLM answer and
    lm-evaluation-harness reads, though the published schema types them as numbers and objects.
    That one documented null is replaced before the schema check; any other null still fails."""
    for choice in body.get("choices") or []:
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if isinstance(lp, dict) and (lp.get("token_logprobs") or [0.0])[0] is None:
            lp["token_logprobs"] = [0.0, *lp["token_logprobs"][1:]]
            top = lp.get("top_logprobs") or []
            lp["top_logprobs"] = [{}, *top[1:]] if top and top[0] is None else top
    return body


def _check_against_openai(case: Any, response: Any) -> None:
    path = case.operation.path
    if response.status_code >= 400:
        if not _content_type(response).startswith("application/json"):
            return
        if path.startswith("/v1/messages"):  # Anthropic's API answers in Anthropic's envelope
            import anthropic.types

            strict(anthropic.types.ErrorResponse, response.json())
        else:
            validate_openai("ErrorResponse", response.json())
        return
    if path == "/v1/embeddings":
        if case.body.get("encoding_format") != "base64":  # OpenAI's schema: arrays only
            validate_openai("CreateEmbeddingResponse", response.json())
        return
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return
    if _content_type(response).startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert not getattr(response, "stream_cut_short", False), "stream read only in part"
        assert events and events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                validate_openai("ErrorResponse", payload)
            elif path == "/v1/chat/completions":
                validate_openai("CreateChatCompletionStreamResponse", payload)
            else:
                validate_completion_chunk(_without_echo_nulls(payload))
        return
    name = ("CreateChatCompletionResponse" if path == "/v1/chat/completions"
            else "CreateCompletionResponse")
    validate_openai(name, _without_echo_nulls(response.json()))


def _run_operation(operation: Any, mode: Any, base_url: str, model: str,
                   failures: list[str]) -> None:
    session = requests.Session()

    method = operation.method.upper()
    examples = (POOLING_EXAMPLES if operation.path in POOLING_PATHS
                else OTHER_POST_EXAMPLES if method == "POST" and operation.path not in CORE_PATHS
                else EXAMPLES.get(method, 40))

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None,
              derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        _pin_model(case, model)
        response = case.call(base_url=base_url, session=session, timeout=15)
        try:
            case.validate_response(response, checks=CHECKS)
            if mode == GenerationMode.POSITIVE and 400 <= response.status_code < 500:
                error = response.json().get("error", {})
                assert response.status_code in (404, 400), response.status_code
                if response.status_code == 400:
                    assert _documented(error), "schema-valid request refused"
            _check_against_openai(case, response)
        except BaseException as exc:  # collect, keep going: one report for the whole run
            if isinstance(exc, KeyboardInterrupt):
                raise
            body = json.dumps(case.body)[:400] if isinstance(case.body, (dict, list)) else ""
            failures.append(f"{operation.label} [{mode.value}] {response.status_code} "
                            f"{response.text[:300]!r}\n  {exc!s:.600}\n  body: {body}")

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        pass  # no negative data exists for an operation without parameters
    except schemathesis.errors.InvalidSchema as exc:
        # schemathesis cannot build negative data for some valid schemas (e.g. "Cannot generate
        # an array with 1 demanded elements" for count_tokens); positive data must always work
        if mode == GenerationMode.POSITIVE:
            failures.append(f"{operation.label} [positive] cannot generate: {exc}")


async def _load_schema(url: str) -> Any:
    raw = await asyncio.to_thread(requests.get, f"{url}/openapi.json", timeout=5)
    schema = schemathesis.openapi.from_dict(raw.json())
    # schemathesis reads an event stream only up to 20 events by default and then hangs up
    # (its guard against streams that never end): a streamed completion of 20 prompts x n
    # choices has more, and was cut after each choice's first chunk. Every stream here ends.
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    return schema


async def test_a_stream_of_many_choices_is_read_to_its_end(gateway: GatewayService,
                                                           tokenizer: FakeTokenizer,
                                                           model: str) -> None:
    """The shape that once looked truncated: 20 token-id prompts x n=2, streamed (161 events).
    Read through schemathesis as the run below reads it, it ends with [DONE]."""
    schema = await _load_schema(gateway.url)
    operation = schema["/v1/completions"]["POST"]
    body = {"model": model, "prompt": [[65 + i, 66 + i] for i in range(20)], "n": 2,
            "stream": True}
    case = operation.Case(body=body, media_type="application/json")
    response = await asyncio.to_thread(case.call, base_url=gateway.url,
                                       session=requests.Session(), timeout=15)
    _check_against_openai(case, response)
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 20 * 2 * 4 + 1  # 3 words and a final chunk per choice, [DONE]


@pytest.mark.slow
async def test_schemathesis_finds_no_disagreement(gateway: GatewayService,
                                                  tokenizer: FakeTokenizer, model: str) -> None:
    schema = await _load_schema(gateway.url)
    failures: list[str] = []
    # schemathesis draws some values from the global `random`: seeded, the examples are the
    # same whatever ran before in the session (a CI run checks what a lone run checks)
    random.seed(0)

    def run_all() -> None:
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _run_operation(operation, mode, gateway.url, model, failures)

    await asyncio.to_thread(run_all)  # the gateway serves on this event loop meanwhile
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
