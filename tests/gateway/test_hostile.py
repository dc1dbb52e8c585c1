"""Hostile input against the real gateway (uvicorn, real NATS, fake tokenizer): every case gets
its 4xx in OpenAI's envelope, fast; the gateway keeps serving, and its memory stays bounded.

The envelope is checked against the official OpenAI schema (tests/gateway/schemas.py); limits
are the GatewaySettings defaults (conftest leaves them alone), so each case is also a check
that the default is what the docs say."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from flotilla.libs.common.settings import GatewaySettings
from flotilla.services.gateway.service import GatewayService
from tests.gateway.conftest import chat
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai

DEFAULTS = GatewaySettings(_env_file=None)  # type: ignore[call-arg]
FAST_S = 1.0  # every refusal below is answered within this (on 2 busy cores)


def _nested(depth: int) -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name,
                                             "parameters": parameters or {"type": "object"}}}


# (what, endpoint, body (dict: "M" is the served model; bytes: sent as is), status, param, code)
HOSTILE: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("seed 2^64", "chat", chat("M", seed=2**64), 400, "seed", None),
    ("seed 2^64 - 1 with n 2", "chat", chat("M", seed=2**64 - 1, n=2), 400, "seed", None),
    ("seed below -2^63", "chat", chat("M", seed=-2**63 - 1), 400, "seed", None),
    ("seed as a huge float", "chat", chat("M", seed=1e30), 400, "seed", None),
    ("top_k past 32 bits", "chat", chat("M", top_k=10**30), 400, "top_k", None),
    ("max_tokens past 32 bits", "chat", chat("M", max_tokens=2**40), 400, "max_tokens", None),
    ("n far past max_n", "chat", chat("M", n=10**12), 400, "n", None),
    ("logprobs past 5", "completions", {"model": "M", "prompt": "x", "logprobs": 99}, 400,
     "logprobs", None),
    ("top_logprobs without logprobs", "chat", chat("M", top_logprobs=3), 400, "logprobs", None),
    ("token id float", "completions", {"model": "M", "prompt": [1, 2.5]}, 400, "prompt[1]",
     None),
    ("token id negative", "completions", {"model": "M", "prompt": [1, -1]}, 400, "prompt[1]",
     None),
    ("token id bool", "completions", {"model": "M", "prompt": [True]}, 400, "prompt[0]", None),
    ("token id past 32 bits", "completions", {"model": "M", "prompt": [2**40]}, 400,
     "prompt[0]", None),
    ("token id past 64 bits", "completions", {"model": "M", "prompt": [2**70]}, 400,
     "prompt[0]", None),
    ("bad id deep in a long prompt", "completions", {"model": "M", "prompt": [5] * 200_000 + [-1]},
     400, "prompt[200000]", None),
    ("empty token list", "completions", {"model": "M", "prompt": []}, 400, "prompt", None),
    ("nested empty token list", "completions", {"model": "M", "prompt": [[1], []]}, 400,
     "prompt[1]", None),
    ("empty prompt", "completions", {"model": "M", "prompt": ""}, 400, "prompt", None),
    ("empty prompt in a list", "completions", {"model": "M", "prompt": ["a", ""]}, 400,
     "prompt[1]", None),
    ("too many prompts", "completions", {"model": "M", "prompt": ["a"] * 65}, 400, "prompt",
     None),
    ("lone surrogate", "chat", b'{"model": "M", "messages": [{"role": "user", "content": '
                               b'"a\\ud800b"}]}', 400, None, None),
    ("lone low surrogate in a key", "chat", b'{"model": "M", "messages": [{"role": "user", '
                                            b'"\\udc00": 1, "content": "x"}]}', 400, None, None),
    ("invalid UTF-8", "chat", b'{"model": "M", "messages": [{"role": "user", "content": "\xff'
                              b'\xfe"}]}', 400, None, None),
    ("overlong UTF-8", "chat", b'{"model": "M", "messages": [{"role": "user", "content": "\xc0'
                               b'\xaf"}]}', 400, None, None),
    ("100k-deep JSON", "chat", _nested(100_000), 400, None, "json_too_deep"),
    ("JSON one past the depth limit", "chat", _nested(DEFAULTS.max_json_depth), 400, None,
     "json_too_deep"),
    ("NaN", "chat", b'{"model": "M", "messages": [], "temperature": NaN}', 400, None, None),
    ("500 tools", "chat", chat("M", tools=[_tool(f"t{i}") for i in range(500)]), 400, "tools",
     None),
    ("too many messages", "chat", {"model": "M", "messages": [
        {"role": "user", "content": "x"}] * (DEFAULTS.max_messages + 1)}, 400, "messages", None),
    ("huge tool schema", "chat", chat("M", tools=[_tool("big", {
        "type": "object", "description": "x" * DEFAULTS.max_schema_bytes})]), 400,
     "tools[0].function", "schema_too_large"),
    ("huge response_format schema", "chat", chat("M", response_format={
        "type": "json_schema", "json_schema": {"name": "big", "schema": {
            "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}),
     400, "response_format", "schema_too_large"),
    ("17 stop strings", "chat", chat("M", stop=["s"] * 17), 400, "stop", None),
    ("a stop string too long", "chat", chat("M", stop=["s" * 513]), 400, "stop[0]", None),
    ("2,048 messages, the last one bad", "chat", {"model": "M", "messages": [
        {"role": "user", "content": "x"}] * (DEFAULTS.max_messages - 1) + [
        {"role": "user", "content": "x", "audio": 1}]}, 400,
     f"messages[{DEFAULTS.max_messages - 1}].audio", None),
    ("tool_call_id empty", "chat", {"model": "M", "messages": [
        {"role": "tool", "tool_call_id": "", "content": "x"}]}, 400, "messages[0].tool_call_id",
     None),
]


async def _post(client: httpx.AsyncClient, endpoint: str, body: Any, model: str,
                headers: dict[str, str] | None = None) -> httpx.Response:
    url = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        raw = body.replace(b'"M"', json.dumps(model).encode())
        return await client.post(url, content=raw, headers={"content-type": "application/json",
                                                            **(headers or {})})
    return await client.post(url, json={**body, "model": model}, headers=headers)


def _assert_envelope(r: httpx.Response, status: int, param: str | None = None,
                     code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    validate_openai("ErrorResponse", body)
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("what,endpoint,body,status,param,code", HOSTILE,
                         ids=[c[0] for c in HOSTILE])
async def test_hostile_input_is_a_fast_4xx(client: httpx.AsyncClient, model: str, what: str,
                                           endpoint: str, body: Any, status: int,
                                           param: str | None, code: str | None) -> None:
    started = time.monotonic()
    r = await _post(client, endpoint, body, model)
    elapsed = time.monotonic() - started
    _assert_envelope(r, status, param, code)
    assert elapsed < FAST_S, f"{what}: {elapsed:.2f}s"
    after = await client.post("/v1/chat/completions", json=chat(model, max_tokens=3))
    assert after.status_code == 200, after.text


async def test_token_ids_written_as_floats_are_integers(client: httpx.AsyncClient, model: str,
                                                        tokenizer: FakeTokenizer) -> None:
    """JSON Schema calls 2.0 an integer, so the spec accepts it: the prompt is [1, 2]."""
    r = await client.post("/v1/completions", content=json.dumps(
        {"model": model, "prompt": [1, 2.0, 3e0], "n": 1.0, "max_tokens": 4.0}),
        headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("cmpl-")
    [sent] = [q for q in tokenizer.requests if q.request_id == f"{rid}-0"]
    assert sent.prompt == [1, 2, 3] and all(type(t) is int for t in sent.prompt)
    assert sent.sampling.max_tokens == 4


@pytest.mark.parametrize("seed,n,expected", [
    (2**63 - 1, 2, [2**63 - 1, 0]),  # seed + i wraps into the engine's [0, 2^63)
    (-1, 2, [2**63 - 1, 0]),
    (-2**63, 1, [0]),
    (7, 3, [7, 8, 9]),
])
async def test_any_int64_seed_reaches_the_engine_in_range(
        client: httpx.AsyncClient, model: str, tokenizer: FakeTokenizer, seed: int, n: int,
        expected: list[int]) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, seed=seed, n=n))
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("chatcmpl-")
    sent = sorted((q for q in tokenizer.requests if q.request_id.startswith(rid)),
                  key=lambda q: q.request_id)
    assert [q.sampling.seed for q in sent] == expected


async def test_body_over_the_limit_is_413_before_it_is_read(client: httpx.AsyncClient,
                                                           model: str) -> None:
    """A Content-Length over max_body_bytes: 413 without the gateway reading the body."""
    size = DEFAULTS.max_body_bytes + 1
    started = time.monotonic()
    r = await client.post("/v1/chat/completions", content=b" " * size,
                          headers={"content-type": "application/json"})
    _assert_envelope(r, 413, code="request_too_large")
    assert time.monotonic() - started < 2.0


async def _chunks(total: int, chunk: bytes) -> Any:
    sent = 0
    while sent < total:
        yield chunk
        sent += len(chunk)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def test_four_50mb_chunked_bodies_at_once_stay_within_the_cap(
        client: httpx.AsyncClient, model: str) -> None:
    """Bodies without a Content-Length are read up to max_body_bytes, then 413: four 50 MB
    bodies at once grow this process (gateway and client in one) by well under 4 x 50 MB."""
    chunk = b" " * 65536  # one shared chunk: the client side holds no copy of the body
    before = _rss_mib()
    replies = await asyncio.gather(*(client.post(
        "/v1/completions", content=_chunks(50 * 1024 * 1024, chunk),
        headers={"content-type": "application/json"}) for _ in range(4)),
        return_exceptions=True)
    grown = _rss_mib() - before
    statuses = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__
                for r in replies]
    # A client still sending when the gateway answers may see the connection close instead.
    assert all(s in (413, "RemoteProtocolError", "WriteError", "ReadError") for s in statuses), \
        statuses
    assert 413 in statuses
    assert grown < 4 * DEFAULTS.max_body_bytes / 2**20 + 24, f"RSS grew {grown:.0f} MiB"
    after = await client.post("/v1/chat/completions", json=chat(model, max_tokens=3))
    assert after.status_code == 200


async def _raw_head(gateway: GatewayService, head_parts: list[bytes]) -> tuple[bytes, float]:
    """Send a request head in pieces on a raw socket; the response and seconds to it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    started = time.monotonic()

    async def send() -> None:
        try:
            for part in head_parts:
                writer.write(part)
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the gateway closed the connection: what it answered is read below

    sender = asyncio.ensure_future(send())
    response = await asyncio.wait_for(reader.read(65536), timeout=10)
    elapsed = time.monotonic() - started
    sender.cancel()
    writer.close()
    return response, elapsed


async def test_a_10mb_header_is_refused_while_it_arrives(gateway: GatewayService,
                                                        client: httpx.AsyncClient,
                                                        model: str) -> None:
    head = [b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: "]
    head += [b"a" * 65536] * 160 + [b"\r\n\r\n"]  # 10 MiB of one header value
    response, elapsed = await _raw_head(gateway, head)
    status_line, _, rest = response.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 431 Request Header Fields Too Large", response[:200]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    validate_openai("ErrorResponse", body)
    assert body["error"]["code"] == "request_header_fields_too_large"
    assert elapsed < FAST_S
    assert (await client.get("/v1/models")).status_code == 200


async def test_too_many_headers_are_refused(gateway: GatewayService) -> None:
    fields = b"".join(b"X-H%d: v\r\n" % i for i in range(DEFAULTS.max_headers + 1))
    response, _ = await _raw_head(gateway, [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + fields
                                            + b"\r\n"])
    assert response.startswith(b"HTTP/1.1 431 "), response[:200]


async def test_headers_within_the_limits_are_served(gateway: GatewayService) -> None:
    fields = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 500) for i in range(DEFAULTS.max_headers - 2))
    response, _ = await _raw_head(gateway, [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + fields
                                            + b"Connection: close\r\n\r\n"])
    assert response.startswith(b"HTTP/1.1 200 "), response[:200]


@pytest.mark.slow
async def test_thousands_of_distinct_schemas_keep_memory_bounded(gateway: GatewayService,
                                                                 model: str) -> None:
    """2,000 requests, each with its own response_format schema, 8 at a time: the gateway keeps
    nothing per schema (this process also holds the fake tokenizer's log of requests)."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=15,
                                 limits=httpx.Limits(max_connections=8)) as http:
        async def one(i: int) -> int:
            schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"}
                                                       for j in range(8)}}
            r = await http.post("/v1/chat/completions", json=chat(
                model, "quick", max_tokens=3, response_format={
                    "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}))
            return r.status_code

        await asyncio.gather(*(one(i) for i in range(8)))  # warm
        before = _rss_mib()
        statuses: list[int] = []
        for start in range(0, 2000, 8):
            statuses += await asyncio.gather(*(one(i) for i in range(start, start + 8)))
    grown = _rss_mib() - before
    assert set(statuses) == {200}
    assert grown < 40, f"RSS grew {grown:.1f} MiB over 2,000 schemas"


async def test_bad_request_timeout_header_names_it(client: httpx.AsyncClient,
                                                   model: str) -> None:
    for value in ("soon", "0.5", "nan", "-3", "inf"):
        r = await client.post("/v1/chat/completions", json=chat(model),
                              headers={"X-Request-Timeout": value})
        _assert_envelope(r, 400, param="X-Request-Timeout")


async def test_large_bodies_on_a_kept_alive_connection_are_not_heads(client: httpx.AsyncClient,
                                                                     model: str) -> None:
    """Requests that arrive whole in one read, then a body larger than max_header_bytes on the
    same connection: only head bytes count against the head limit."""
    big = "x" * (DEFAULTS.max_header_bytes + 10_000)
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=chat(model))).status_code == 200
        r = await client.post("/v1/chat/completions", json=chat(model, big))
        assert r.status_code == 200, r.text[:300]
