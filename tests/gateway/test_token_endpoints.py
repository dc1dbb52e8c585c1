"""`/tokenize`, `/v1/tokenize`, `/detokenize` and `/v1/detokenize` in vLLM's shapes, over the fake
tokenizer (one token per character, BOS = 1 with `add_special_tokens`)."""

from __future__ import annotations

import httpx
import pytest

from flotilla.services.gateway.service import GatewayService
from tests.gateway.fakes import BOS, MAX_MODEL_LEN
from tests.gateway.schemas import validate_ours
from tests.gateway.test_http import assert_error

HEY = [{"role": "user", "content": "hey"}]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
async def test_tokenize_a_prompt(client: httpx.AsyncClient, model: str, path: str) -> None:
    r = await client.post(path, json={"model": model, "prompt": "abc"})
    assert r.status_code == 200, r.text
    body = r.json()
    validate_ours("TokenizeResponse", body)
    assert body == {"model": model, "prompt": "abc", "tokens": [BOS, 97, 98, 99], "count": 4,
                    "max_model_len": MAX_MODEL_LEN, "token_strs": None}
    r = await client.post(path, json={"model": model, "prompt": "abc",
                                      "add_special_tokens": False, "return_token_strs": True})
    assert (r.json()["tokens"], r.json()["token_strs"]) == ([97, 98, 99], ["a", "b", "c"])


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
async def test_tokenize_messages(client: httpx.AsyncClient, model: str, path: str) -> None:
    r = await client.post(path, json={"model": model, "tools": [], "messages": HEY})
    assert r.status_code == 200, r.text
    body = r.json()
    validate_ours("TokenizeResponse", body)
    assert body["prompt"] == "<user>hey<assistant>"
    assert body["tokens"] == [ord(c) for c in body["prompt"]] and body["count"] == 20
    r = await client.post(path, json={"model": model, "tools": [], "messages": HEY,
                                      "add_generation_prompt": False,
                                      "add_special_tokens": True, "return_token_strs": True})
    body = r.json()
    assert body["prompt"] == "<user>hey"
    assert body["tokens"] == [BOS, *map(ord, "<user>hey")]
    assert body["token_strs"] == ["<s>", *"<user>hey"]
    r = await client.post(path, json={"model": model, "tools": [], "messages": HEY,
                                      "continue_final_message": True})
    assert r.json()["prompt"] == "<user>hey"  # continuing the last message opens no turn


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
async def test_detokenize(client: httpx.AsyncClient, model: str, path: str) -> None:
    r = await client.post(path, json={"model": model, "tokens": [104, 105]})
    assert r.status_code == 200, r.text
    validate_ours("DetokenizeResponse", r.json())
    assert r.json() == {"model": model, "prompt": "hi"}
    assert_error(await client.post(path, json={"model": model, "tokens": [0x110000]}), 400,
                 param="tokens")
    assert_error(await client.post(path, json={"model": model, "tokens": [-1]}), 400,
                 param="tokens[0]")
    assert_error(await client.post(path, json={"model": model}), 400, param="tokens")


async def test_token_endpoint_errors(client: httpx.AsyncClient, model: str) -> None:
    assert_error(await client.post("/tokenize", json={"model": model}), 400,
                 contains="exactly one of")
    assert_error(await client.post("/v1/tokenize", json={"model": "nope", "prompt": "x"}), 404,
                 code="model_not_found")
    assert_error(await client.post("/tokenize", json={
        "model": model, "messages": HEY, "continue_final_message": True,
        "add_generation_prompt": True}), 400, param="continue_final_message")


async def test_model_may_be_left_out_when_one_is_served(client: httpx.AsyncClient,
                                                        gateway: GatewayService) -> None:
    """vLLM makes `model` optional; here it is, while exactly one model is served."""
    served = await gateway.state.registry.models()
    r = await client.post("/v1/detokenize", json={"tokens": [104, 105]})
    if len(served) == 1:
        assert r.status_code == 200 and r.json() == {"model": served[0].id, "prompt": "hi"}
    else:
        assert_error(r, 400, param="model", contains=f"serves {len(served)} models")
