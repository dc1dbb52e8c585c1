"""Each HTTP request is a `gateway.request` server span, and the bus carries its trace onward."""

from __future__ import annotations

import httpx
from opentelemetry.trace import SpanKind

from tests.gateway.conftest import chat
from tests.gateway.fakes import FakeTokenizer
from tests.tracing import memory_exporter


async def test_request_span_reaches_the_tokenizer(client: httpx.AsyncClient, model: str,
                                                  tokenizer: FakeTokenizer) -> None:
    exporter = memory_exporter()
    r = await client.post("/v1/chat/completions", json=chat(model))
    assert r.status_code == 200
    spans = [s for s in exporter.get_finished_spans() if s.name == "gateway.request"]
    span = next(s for s in spans
                if (s.attributes or {}).get("url.path") == "/v1/chat/completions")
    attributes = dict(span.attributes or {})
    assert span.kind == SpanKind.SERVER
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.response.status_code"] == 200
    assert attributes["http.route"] == "/v1/chat/completions"
    rid = r.json()["id"].removeprefix("chatcmpl-")
    assert span.context is not None
    assert tokenizer.trace_ids[f"{rid}-0"] == span.context.trace_id != 0
