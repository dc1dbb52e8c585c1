"""Our OpenAPI document: a valid OpenAPI 3.1 file, found from the source tree and the package,
routed exactly, and — for the parameters we accept — the same contract as OpenAI's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from libs.common.errors import FlotillaError
from services.gateway import spec as spec_module
from services.gateway.health import router as health_router
from services.gateway.routes import router
from services.gateway.spec import Spec, find_spec
from tests.gateway.schemas import OFFICIAL_SPEC, validate_openai

VLLM_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "chat_template_kwargs",
                   "response_format"}  # vLLM accepts response_format on completions too

GOOD_CHAT: list[dict[str, Any]] = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "w",
                                                                            "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
     "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 5,
     "temperature": 0, "top_p": 1, "n": 2, "stop": ["\n"], "seed": 1, "presence_penalty": 2,
     "frequency_penalty": -2, "logprobs": True, "top_logprobs": 20, "user": "u",
     "tools": [{"type": "function", "function": {"name": "w", "description": "weather",
                                                 "parameters": {"type": "object"}}}],
     "tool_choice": {"type": "function", "function": {"name": "w"}},
     "parallel_tool_calls": False, "response_format": {"type": "text"}},
]
GOOD_COMPLETIONS: list[dict[str, Any]] = [
    {"model": "m", "prompt": "once"},
    {"model": "m", "prompt": ["a", "b"], "max_tokens": 3, "n": 2, "echo": True, "logprobs": 5,
     "stop": "x", "seed": 3, "stream": True, "stream_options": {"include_usage": True},
     "best_of": 1, "temperature": 1.5, "top_p": 0.9},
    {"model": "m", "prompt": [1, 2, 3]},
    {"model": "m", "prompt": [[1, 2], [3]]},
]


@pytest.fixture(scope="module")
def spec() -> Spec:
    return Spec.load()


def test_spec_is_valid_openapi_31(spec: Spec) -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(spec.document)
    assert spec.document["openapi"].startswith("3.1")


def test_packaged_copy_is_the_same_file() -> None:
    repo_file = Path(spec_module.__file__).resolve().parents[2] / "openapi" / "flotilla.yaml"
    packaged = Path(spec_module.__file__).resolve().parent / "flotilla.yaml"
    assert packaged.read_bytes() == repo_file.read_bytes()
    assert find_spec() == repo_file


def test_missing_spec_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        find_spec(tmp_path / "nope.yaml")


def test_every_spec_operation_is_routed(spec: Spec) -> None:
    routed = {(getattr(route, "path", "").replace(":path", ""), method.lower())
              for route in [*router.routes, *health_router.routes]
              for method in getattr(route, "methods", ())}
    documented = {(path, method) for path, item in spec.document["paths"].items()
                  for method in item if method in ("get", "post")}
    assert documented <= routed
    assert routed - documented == {("/openapi.json", "get")}


@pytest.mark.parametrize("ours,official", [
    ("ChatCompletionRequest", "CreateChatCompletionRequest"),
    ("CompletionRequest", "CreateCompletionRequest"),
])
def test_request_parameters_are_openai_names(spec: Spec, ours: str, official: str) -> None:
    document = json.loads(OFFICIAL_SPEC.read_text())
    schemas = document["components"]["schemas"]

    def props(schema: dict[str, Any]) -> set[str]:
        names = set(schema.get("properties", {}))
        for part in schema.get("allOf", []):
            names |= props(schemas[part["$ref"].rsplit("/", 1)[-1]] if "$ref" in part else part)
        return names

    accepted = set(spec.document["components"]["schemas"][ours]["properties"])
    assert accepted - props(schemas[official]) <= VLLM_EXTENSIONS


@pytest.mark.parametrize("body", GOOD_CHAT)
def test_good_chat_requests_pass_both_specs(spec: Spec, body: dict[str, Any]) -> None:
    spec.validate("createChatCompletion", body)
    validate_openai("CreateChatCompletionRequest", body)


@pytest.mark.parametrize("body", GOOD_COMPLETIONS)
def test_good_completion_requests_pass_both_specs(spec: Spec, body: dict[str, Any]) -> None:
    spec.validate("createCompletion", body)
    validate_openai("CreateCompletionRequest", body)


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 1.5}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": "m", "messages": [{"role": "assistant"}]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "maybe"},
     "tool_choice"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
])
def test_invalid_values_name_their_parameter(spec: Spec, body: dict[str, Any],
                                             param: str) -> None:
    with pytest.raises(FlotillaError) as err:
        spec.validate("createChatCompletion", body)
    assert err.value.status == 400 and err.value.info.param == param
    assert f"`{param}`" in err.value.info.message


def test_spec_file_is_yaml_not_a_copy_of_openai(spec: Spec) -> None:
    text = find_spec().read_text()
    assert yaml.safe_load(text) == spec.document
    official = json.loads(OFFICIAL_SPEC.read_text())
    ours = spec.document["components"]["schemas"]
    theirs = official["components"]["schemas"]
    for name in ours:
        if name in theirs:
            assert ours[name] != theirs[name], name
