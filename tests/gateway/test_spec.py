"""Our OpenAPI document: a valid OpenAPI 3.1 file, found from the source tree and the package,
routed exactly, and — for the parameters we accept — the same contract as OpenAI's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flotilla.libs.common.errors import FlotillaError
from flotilla.services.gateway import spec as spec_module
from flotilla.services.gateway.anthropic.routes import router as anthropic_router
from flotilla.services.gateway.conversations.routes import router as conversations_router
from flotilla.services.gateway.health import router as health_router
from flotilla.services.gateway.pooling_routes import router as pooling_router
from flotilla.services.gateway.responses.routes import router as responses_router
from flotilla.services.gateway.routes import router
from flotilla.services.gateway.spec import Spec, apply_limits, find_spec
from flotilla.services.gateway.token_routes import router as token_router
from tests.gateway.schemas import OFFICIAL_SPEC, validate_openai

VLLM_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "chat_template_kwargs",
                   "response_format",  # vLLM accepts response_format on completions too
                   "min_tokens", "stop_token_ids", "prompt_logprobs", "skip_special_tokens",
                   "include_stop_str_in_output", "priority", "structured_outputs",
                   "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "guided_decoding_backend", "echo", "add_generation_prompt",
                   "continue_final_message", "logit_bias",
                   "truncate_prompt_tokens", "normalize", "add_special_tokens"}  # embeddings
LLAMA_CPP_EXTENSIONS = {"n_predict", "cache_prompt", "json_schema", "grammar"}
# accepted on /v1/completions too, without effect on the output (OpenAI has them on chat only)
NO_EFFECT = {"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
FLOTILLA_EXTENSIONS = {"conversation"}  # chat in a server-kept conversation (api_compatibility)

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
    # OpenAI's fields that do not change the output
    {"model": "m", "messages": [{"role": "user", "content": "q"}],
     "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "p",
     "safety_identifier": "s", "user": "u", "logit_bias": {"50256": -100},
     "reasoning_effort": "low", "verbosity": "medium", "modalities": ["text"],
     "prediction": {"type": "content", "content": "x"},
     "prompt_cache_retention": "in_memory", "max_completion_tokens": 5},
    # legacy function calling
    {"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "function_call": {"name": "w",
                                                                  "arguments": "{}"}},
        {"role": "function", "name": "w", "content": "sunny"}],
     "functions": [{"name": "w", "parameters": {"type": "object"}}],
     "function_call": {"name": "w"}},
]
# Valid here, not under OpenAI's published schema: what the SDK itself sends back after
# parse() (`tool_calls: null`, `parsed`) and after its stream helper (`tool_calls[].index`,
# `parsed_arguments`, `annotations: null`), and vLLM / llama.cpp extensions.
GOOD_CHAT_EXTENDED: list[dict[str, Any]] = [
    {"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"content": '{"a": 1}', "refusal": None, "role": "assistant", "tool_calls": None,
         "parsed": {"a": 1}},
        {"content": "", "refusal": None, "role": "assistant", "annotations": None,
         "audio": None, "function_call": None, "parsed": None, "tool_calls": [
             {"id": "c1", "function": {"arguments": "{}", "name": "w",
                                       "parsed_arguments": None},
              "type": "function", "index": 0}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]},
    {"model": "m", "messages": [{"role": "user", "content": "q"}], "min_tokens": 1,
     "stop_token_ids": [2], "skip_special_tokens": False, "include_stop_str_in_output": True,
     "prompt_logprobs": 0, "priority": 1, "echo": True, "add_generation_prompt": False,
     "continue_final_message": True, "n_predict": -1, "cache_prompt": True,
     "structured_outputs": {"choice": ["a", "b"]}, "guided_decoding_backend": "xgrammar"},
]
GOOD_COMPLETIONS: list[dict[str, Any]] = [
    {"model": "m", "prompt": "once"},
    {"model": "m", "prompt": ["a", "b"], "max_tokens": 3, "n": 2, "echo": True, "logprobs": 5,
     "stop": "x", "seed": 3, "stream": True, "stream_options": {"include_usage": True},
     "best_of": 1, "temperature": 1.5, "top_p": 0.9},
    {"model": "m", "prompt": [1, 2, 3]},
    {"model": "m", "prompt": [[1, 2], [3]]},
    {"model": "m", "prompt": "def f(", "suffix": "    return x", "logit_bias": {"1": 2},
     "echo": True, "logprobs": 0, "user": "u"},
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
              for r in (router, anthropic_router, responses_router, token_router, health_router,
                        pooling_router, conversations_router)
              for route in r.routes for method in getattr(route, "methods", ())}
    documented = {(path, method) for path, item in spec.document["paths"].items()
                  for method in item if method in ("get", "post", "delete")}
    assert documented <= routed
    undocumented = {(path, method) for path, method in routed - documented
                    if path != "/v1/messages/{rest}"}  # other Messages URLs: a 404 route
    assert undocumented == {("/openapi.json", "get")}


@pytest.mark.parametrize("ours,official", [
    ("ChatCompletionRequest", "CreateChatCompletionRequest"),
    ("CompletionRequest", "CreateCompletionRequest"),
    ("EmbeddingRequest", "CreateEmbeddingRequest"),
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
    allowed = VLLM_EXTENSIONS | LLAMA_CPP_EXTENSIONS | NO_EFFECT | FLOTILLA_EXTENSIONS
    assert accepted - props(schemas[official]) <= allowed


@pytest.mark.parametrize("body", GOOD_CHAT)
def test_good_chat_requests_pass_both_specs(spec: Spec, body: dict[str, Any]) -> None:
    spec.validate("createChatCompletion", body)
    validate_openai("CreateChatCompletionRequest", body)


@pytest.mark.parametrize("body", GOOD_CHAT_EXTENDED)
def test_sdk_history_and_extensions_pass_our_spec(spec: Spec, body: dict[str, Any]) -> None:
    spec.validate("createChatCompletion", body)


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
    document = yaml.safe_load(find_spec().read_text())
    apply_limits(document)  # the file's own numbers in the x-error-message placeholders
    assert document == spec.document
    official = json.loads(OFFICIAL_SPEC.read_text())
    ours = spec.document["components"]["schemas"]
    theirs = official["components"]["schemas"]
    for name in ours:
        if name in theirs:
            assert ours[name] != theirs[name], name


def test_spec_file_has_no_duplicate_keys() -> None:
    """YAML keeps the last of two equal keys silently: a second schema of the same name would
    replace the first everywhere it is referenced."""

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader: Strict, node: yaml.MappingNode) -> dict[Any, Any]:
        keys = [loader.construct_object(k) for k, _ in node.value]
        duplicates = {k for k in keys if keys.count(k) > 1}
        assert not duplicates, f"duplicate keys {duplicates} at line {node.start_mark.line + 1}"
        return dict(loader.construct_pairs(node))

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    yaml.load(find_spec().read_text(), Loader=Strict)  # noqa: S506 - a SafeLoader subclass
