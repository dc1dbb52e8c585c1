"""Non-streaming endpoints over real HTTP: shapes checked against OpenAI's published schemas (and
our own spec), choices fanned out per `n` and per prompt, errors in the envelope."""

from __future__ import annotations

import httpx
import pytest
import yaml

from flotilla.services.gateway.limits import spec_limits
from flotilla.services.gateway.service import GatewayService
from flotilla.services.gateway.spec import apply_limits, find_spec
from tests.gateway.conftest import chat
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai, validate_ours


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    validate_openai("ErrorResponse", body)
    validate_ours("ErrorResponse", body)
    error = body["error"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert contains in error["message"], error
    return error


async def test_chat_completion_matches_openai_schema(client: httpx.AsyncClient, model: str) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, max_tokens=5))
    assert r.status_code == 200, r.text
    body = r.json()
    validate_openai("CreateChatCompletionResponse", body)
    validate_ours("ChatCompletion", body)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == model and body["system_fingerprint"]
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello world !", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 2}}


async def test_n_choices_get_own_request_ids_and_seeds(client: httpx.AsyncClient, model: str,
                                                       tokenizer: FakeTokenizer) -> None:
    r = await client.post("/v1/chat/completions",
                          json=chat(model, "seeded", n=3, seed=100, temperature=0.7, top_k=-1))
    assert r.status_code == 200, r.text
    body = r.json()
    validate_openai("CreateChatCompletionResponse", body)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    rid = body["id"].removeprefix("chatcmpl-")
    sent = {q.request_id: q for q in tokenizer.requests if q.request_id.startswith(rid)}
    assert sorted(sent) == [f"{rid}-{i}" for i in range(3)]
    assert [sent[f"{rid}-{i}"].sampling.seed for i in range(3)] == [100, 101, 102]
    first = sent[f"{rid}-0"]
    assert first.sampling.temperature == 0.7 and first.sampling.top_k == 0
    assert first.stream_subject.endswith(rid + "-0")
    # n choices share one prompt: counted once; completion tokens add up.
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 9


async def test_parameters_reach_the_tokenizer(client: httpx.AsyncClient, model: str,
                                              tokenizer: FakeTokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
        {"role": "user", "content": "params"},
    ]
    r = await client.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_completion_tokens": 9, "max_tokens": 50,
        "stop": "END", "top_p": 0.5, "min_p": 0.1, "repetition_penalty": 1.2,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "ignore_eos": True, "user": "u",
        "chat_template_kwargs": {"enable_thinking": False}, "response_format": {"type": "text"},
        "tools": [], "tool_choice": "auto", "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    req = next(q for q in tokenizer.requests if q.request_id.startswith(
        r.json()["id"].removeprefix("chatcmpl-")))
    s = req.sampling
    assert (s.max_tokens, s.top_p, s.min_p, s.repetition_penalty) == (9, 0.5, 0.1, 1.2)
    assert (s.presence_penalty, s.frequency_penalty, s.ignore_eos) == (0.5, -0.5, True)
    assert req.stop == ["END"] and req.chat_template_kwargs == {"enable_thinking": False}
    assert req.tools is None and req.parallel_tool_calls is False
    assert req.messages is not None
    assert req.messages[1]["content"] == "a\nb"  # text parts joined
    assert "refusal" not in req.messages[2] and req.messages[2]["tool_calls"][0]["id"] == "c1"
    assert req.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "done"}


async def test_tool_calls_and_reasoning(client: httpx.AsyncClient, model: str) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, "tools", tools=[]))
    body = r.json()
    validate_openai("CreateChatCompletionResponse", body)
    validate_ours("ChatCompletion", body)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    r = await client.post("/v1/chat/completions", json=chat(model, "think"))
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think." and message["content"] == "42"


async def test_chat_logprobs(client: httpx.AsyncClient, model: str,
                             tokenizer: FakeTokenizer) -> None:
    r = await client.post("/v1/chat/completions",
                          json=chat(model, "lp", logprobs=True, top_logprobs=2))
    body = r.json()
    validate_openai("CreateChatCompletionResponse", body)
    validate_ours("ChatCompletion", body)
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " world", " !"]
    assert content[0]["top_logprobs"][1] == {"token": "x", "logprob": -2.0, "bytes": [120]}
    rid = body["id"].removeprefix("chatcmpl-")
    assert next(q for q in tokenizer.requests if q.request_id == f"{rid}-0").sampling.logprobs == 2


async def test_completions_list_prompt_times_n(client: httpx.AsyncClient, model: str,
                                               tokenizer: FakeTokenizer) -> None:
    r = await client.post("/v1/completions", json={
        "model": model, "prompt": ["one", "two"], "n": 2, "logprobs": 1, "echo": False})
    assert r.status_code == 200, r.text
    body = r.json()
    validate_openai("CreateCompletionResponse", body)
    validate_ours("Completion", body)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hello world !" for c in body["choices"])
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 5, 11]
    assert body["usage"]["prompt_tokens"] == 14  # two prompts, each counted once
    assert body["usage"]["completion_tokens"] == 12
    rid = body["id"].removeprefix("cmpl-")
    sent = sorted((q for q in tokenizer.requests if q.request_id.startswith(rid)),
                  key=lambda q: q.request_id)
    assert [q.prompt for q in sent] == ["one", "one", "two", "two"]
    assert all(q.kind == "completion" and q.sampling.max_tokens == 16 for q in sent)


async def test_completions_token_prompts(client: httpx.AsyncClient, model: str,
                                         tokenizer: FakeTokenizer) -> None:
    for prompt, expected in (([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]])):
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                       "max_tokens": 4})
        assert r.status_code == 200, r.text
        rid = r.json()["id"].removeprefix("cmpl-")
        sent = sorted((q for q in tokenizer.requests if q.request_id.startswith(rid)),
                      key=lambda q: q.request_id)
        assert [q.prompt for q in sent] == expected


async def test_models(client: httpx.AsyncClient, model: str) -> None:
    r = await client.get("/v1/models")
    body = r.json()
    validate_openai("ListModelsResponse", body)
    validate_ours("ModelList", body)
    [entry] = [m for m in body["data"] if m["id"] == model]
    assert entry["owned_by"] == "flotilla" and entry["max_model_len"] == 4096
    r = await client.get(f"/v1/models/{model}")
    assert r.status_code == 200
    validate_openai("Model", r.json())
    assert r.json() == entry
    assert_error(await client.get("/v1/models/no-such/model"), 404, param="model",
                 code="model_not_found")


async def test_health_is_liveness(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok"}


BAD_CHAT = [
    # (what, body or raw bytes, status, param, code, message fragment)
    ("malformed JSON", b'{"model": "m", "messages": [', 400, None, None, "not valid JSON"),
    ("empty body", b"", 400, None, None, "empty"),
    ("not an object", b"[1, 2]", 400, None, None, "expected an object"),
    ("missing messages", {"model": "M"}, 400, "messages", None, "Missing required parameter"),
    ("missing model", {"messages": [{"role": "user", "content": "x"}]}, 400, "model", None,
     "Missing"),
    ("messages wrong type", {"model": "M", "messages": "hi"}, 400, "messages", None,
     "expected an array"),
    ("empty messages", {"model": "M", "messages": []}, 400, "messages", None, "at least 1"),
    ("unknown role", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", None, "wizard"),
    ("content wrong type", {"model": "M", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", None, "must be a string"),
    ("image part", {"model": "M", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content[0].type", None, "not supported"),
    ("tool message without id", {"model": "M", "messages": [{"role": "tool", "content": "x"}]},
     400, "messages[0].tool_call_id", None, "Missing"),
    ("temperature type", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                          "temperature": "hot"}, 400, "temperature", None, "expected a number"),
    ("temperature range", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                           "temperature": 2.5}, 400, "temperature", None, "maximum of 2"),
    ("n zero", {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n",
     None, "minimum"),
    ("n above max_n", {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 5},
     400, "n", None, "maximum of 4"),
    ("max_tokens zero", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 0}, 400, "max_tokens", None, "minimum of 1"),
    ("max_tokens negative", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                             "max_completion_tokens": -3}, 400, "max_completion_tokens", None,
     "minimum"),
    ("top_logprobs range", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                            "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None,
     "maximum"),
    ("too many stops", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                        "stop": ["s"] * 17}, 400, "stop", None, "at most 16"),
    ("unsupported parameter", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                               "best_effort": 2}, 400, "best_effort", None,
     "not supported by this server"),
    ("unsupported nested", {"model": "M", "messages": [{"role": "user", "content": "x",
                                                        "audio": {}}]}, 400,
     "messages[0].audio", None, "not supported by this server"),
    ("json_schema without schema", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                    "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x"}}},
     400, "response_format.json_schema.schema", None, "required"),
    ("json_schema missing", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                             "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", None, "Missing required parameter"),
    ("response_format type", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format.type",
     None, "Supported values"),
    ("chat_template_kwargs not allowed", {
        "model": "M", "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"chat_template": "{{ x }}"}}, 400,
     "chat_template_kwargs.chat_template", None, "not supported by this server"),
    ("template in the request", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                 "chat_template": "{{ x }}"}, 400, "chat_template", None,
     "not supported by this server"),
    ("tool_choice without tools", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                   "tools": [], "tool_choice": "required"}, 400, "tool_choice",
     None, "requires tools"),
    ("tool_choice unknown function", {
        "model": "M", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "a"}}],
        "tool_choice": {"type": "function", "function": {"name": "b"}}}, 400,
     "tool_choice.function.name", None, "not among the tools"),
    ("unknown model", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
     "model", "model_not_found", "nope"),
]


@pytest.mark.parametrize("what,body,status,param,code,fragment", BAD_CHAT,
                         ids=[c[0] for c in BAD_CHAT])
async def test_bad_chat_requests(client: httpx.AsyncClient, model: str, what: str, body: object,
                                 status: int, param: str | None, code: str | None,
                                 fragment: str) -> None:
    if isinstance(body, bytes):
        r = await client.post("/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
    else:
        assert isinstance(body, dict)
        if body.get("model") == "M":
            body = {**body, "model": model}
        r = await client.post("/v1/chat/completions", json=body)
    error = assert_error(r, status, param=param, code=code, contains=fragment)
    assert error["type"] == "invalid_request_error"


BAD_COMPLETIONS = [
    ("unknown parameter", {"typical_p": 0.9}, "typical_p", "not supported by this server"),
    ("logit_bias key", {"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ("best_of", {"best_of": 2}, "best_of", "not supported"),
    ("logprobs range", {"logprobs": 6}, "logprobs", "maximum of 5"),
    ("mixed prompt", {"prompt": [1, "a"]}, "prompt[1]", "expected an integer"),
    ("prompt of another type", {"prompt": {"text": "a"}}, "prompt", "must be a non-empty string"),
    ("empty prompt list", {"prompt": []}, "prompt", "at least 1"),
]


@pytest.mark.parametrize("what,extra,param,fragment", BAD_COMPLETIONS,
                         ids=[c[0] for c in BAD_COMPLETIONS])
async def test_bad_completion_requests(client: httpx.AsyncClient, model: str, what: str,
                                       extra: dict, param: str, fragment: str) -> None:
    r = await client.post("/v1/completions", json={"model": model, "prompt": "x", **extra})
    assert_error(r, 400, param=param, contains=fragment)


async def test_good_request_after_bad_ones(client: httpx.AsyncClient, model: str) -> None:
    await client.post("/v1/chat/completions", content=b"{{{")
    await client.post("/v1/chat/completions", json={"model": model})
    r = await client.post("/v1/chat/completions", json=chat(model, best_of=1) | {"n": 1})
    assert_error(r, 400, param="best_of")
    r = await client.post("/v1/chat/completions", json=chat(model, best_effort=None))
    assert r.status_code == 400
    r = await client.post("/v1/chat/completions", json=chat(model))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world !"


async def test_unknown_route_and_method_use_the_envelope(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404, code="not_found")
    r = await client.get("/v1/chat/completions")
    assert_error(r, 405, code="method_not_allowed")
    assert "POST" in r.headers.get("allow", "")


async def test_openapi_json_is_the_spec_file(client: httpx.AsyncClient,
                                             gateway: GatewayService) -> None:
    r = await client.get("/openapi.json")
    assert r.status_code == 200
    document = yaml.safe_load(find_spec().read_text())
    apply_limits(document, spec_limits(gateway.settings))  # the running server's bounds
    assert r.json() == document
    schemas = r.json()["components"]["schemas"]
    assert schemas["ChoiceCount"]["maximum"] == gateway.settings.max_n == 4
    assert "at most 16 non-empty" in schemas["Stop"]["x-error-message"]
    assert r.json()["paths"]["/v1/chat/completions"]["post"]["operationId"] == \
        "createChatCompletion"
    assert (await client.get("/docs")).status_code == 404
