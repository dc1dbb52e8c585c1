"""/v1/embeddings, /v1/score and /v1/rerank through the real services (engine, tokenizer and
gateway in this process, the real NATS) on a tiny random Qwen3 saved as Qwen3-Embedding ships
(last-token pooling from its sentence-transformers config, a tokenizer that appends EOS,
Matryoshka-trained per its config). The reference is independent: transformers' tokenizer and
Qwen3Model on the same files, pooled and normalized as sentence-transformers does."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.gateway.schemas import validate_openai, validate_ours
from tests.gateway.test_http import assert_error
from tests.pooling.models import VOCAB, reference, save_tiny_qwen3
from tests.pooling.suite import served

TEXTS = [
    "the quick brown fox",
    "a cat sat on the mat",
    "paris is the capital of france",
    "vectors of text",
]


class Suite:
    def __init__(self, path: Path, model: str, hf: Any, url: str) -> None:
        from transformers import AutoTokenizer

        self.path, self.model, self.hf, self.url = path, model, hf, url
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def expected(self, text_or_ids: str | list[int], dimensions: int | None = None) -> torch.Tensor:
        ids = self.ids(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
        return reference(self.hf, ids, "last", dimensions=dimensions)


@pytest.fixture(scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Suite]:
    path = tmp_path_factory.mktemp("qwen3-embedding")
    hf = save_tiny_qwen3(path, "lasttoken", tokenizer=True, is_matryoshka=True)
    model = f"embed-{uuid.uuid4().hex[:8]}"
    async with served(path, model) as url:
        yield Suite(path, model, hf, url)


@pytest.fixture
async def http(suite: Suite) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=suite.url, timeout=30) as client:
        yield client


@pytest.fixture
async def sdk(suite: Suite) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{suite.url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


def close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=1e-4, rtol=1e-4)


async def test_sdk_embeddings_float_and_base64_match_transformers(
    suite: Suite, sdk: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    floats = await sdk.embeddings.create(
        model=suite.model, input=TEXTS, encoding_format="float", user="u-1"
    )
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, floats.data, strict=True):
        close(item.embedding, suite.expected(text))
    assert floats.usage.prompt_tokens == sum(len(suite.ids(t)) for t in TEXTS)
    assert floats.usage.total_tokens == floats.usage.prompt_tokens
    # the SDK's default asks for base64 and decodes it itself
    b64 = await sdk.embeddings.create(model=suite.model, input=TEXTS)
    for a, b in zip(floats.data, b64.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
    raw = await http.post("/v1/embeddings", json={"model": suite.model, "input": TEXTS[0]})
    assert raw.status_code == 200, raw.text
    validate_openai("CreateEmbeddingResponse", raw.json())
    validate_ours("EmbeddingResponse", raw.json())


async def test_token_id_inputs_and_dimensions(suite: Suite, sdk: openai.AsyncOpenAI) -> None:
    one = [5, 17, 42, 99, 3]
    many = [[7, 8, 9], [200, 1, 300, 4, 5, 6]]
    r = await sdk.embeddings.create(model=suite.model, input=one, encoding_format="float")
    close(r.data[0].embedding, suite.expected(one))
    assert r.usage.prompt_tokens == len(one)
    r = await sdk.embeddings.create(model=suite.model, input=many, encoding_format="float")
    for ids, item in zip(many, r.data, strict=True):
        close(item.embedding, suite.expected(ids))
    r = await sdk.embeddings.create(
        model=suite.model, input=TEXTS[:2], dimensions=16, encoding_format="float"
    )
    for text, item in zip(TEXTS, r.data, strict=False):
        assert len(item.embedding) == 16
        close(item.embedding, suite.expected(text, dimensions=16))  # cut, then renormalized


async def test_truncate_prompt_tokens_keeps_the_last_tokens(
    suite: Suite, http: httpx.AsyncClient
) -> None:
    long = list(range(2, 300))  # longer than the 256-token context
    r = await http.post("/v1/embeddings", json={"model": suite.model, "input": long})
    assert_error(r, 400, param="input", code="context_length_exceeded")
    r = await http.post(
        "/v1/embeddings", json={"model": suite.model, "input": long, "truncate_prompt_tokens": 40}
    )
    assert r.status_code == 200, r.text
    close(r.json()["data"][0]["embedding"], suite.expected(long[-40:]))


async def test_score_and_rerank_order_by_independent_cosine(
    suite: Suite, http: httpx.AsyncClient
) -> None:
    query, docs = "where is paris", TEXTS
    q = suite.expected(query)
    cosine = [float(q @ suite.expected(d)) for d in docs]
    r = await http.post("/v1/score", json={"model": suite.model, "text_1": query, "text_2": docs})
    assert r.status_code == 200, r.text
    validate_ours("ScoreResponse", r.json())
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(cosine, abs=1e-4)
    pairs = await http.post(
        "/v1/score", json={"model": suite.model, "text_1": docs[:2], "text_2": docs[2:]}
    )
    want = [
        float(suite.expected(a) @ suite.expected(b))
        for a, b in zip(docs[:2], docs[2:], strict=True)
    ]
    assert [d["score"] for d in pairs.json()["data"]] == pytest.approx(want, abs=1e-4)
    order = sorted(range(len(docs)), key=lambda i: -cosine[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = await http.post(
            path, json={"model": suite.model, "query": query, "documents": docs, "top_n": 3}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        validate_ours("RerankResponse", body)
        assert [x["index"] for x in body["results"]] == order[:3]
        assert [x["document"]["text"] for x in body["results"]] == [docs[i] for i in order[:3]]
        assert [x["relevance_score"] for x in body["results"]] == pytest.approx(
            [cosine[i] for i in order[:3]], abs=1e-4
        )
    r = await http.post(
        "/v1/rerank",
        json={"query": query, "return_documents": False, "documents": [{"text": d} for d in docs]},
    )
    assert r.status_code == 200, r.text  # model left out: the one served
    assert [x["index"] for x in r.json()["results"]] == order
    assert all("document" not in x for x in r.json()["results"])


async def test_hostile_inputs_are_fast_400s(suite: Suite, http: httpx.AsyncClient) -> None:
    m = suite.model
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"model": m, "input": []}, "input"),
        ({"model": m, "input": ["x"] * 10_000}, "input"),
        ({"model": m, "input": [[1, 2], [VOCAB + 5]]}, "input"),
        ({"model": m, "input": [-1]}, "input[0]"),
        ({"model": m, "input": [[["a"]]]}, None),
        ({"model": m, "input": [{"text": "a"}]}, None),
        ({"model": m, "input": ""}, "input"),
        ({"model": m, "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"model": m, "input": "a", "dimensions": 0}, "dimensions"),
        ({"model": m, "input": "a", "dimensions": 65}, "dimensions"),
        ({"model": m, "input": [[3] * 200] * 11}, "input"),  # 2,200 tokens > 2,000 together
        ({"model": m, "input": ["the cat " * 40] * 20}, "input"),  # the same, counted as text
        ({"model": m, "input": "a", "truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens"),
    ]
    for body, param in cases:
        t0 = time.monotonic()
        r = await http.post("/v1/embeddings", json=body)
        assert time.monotonic() - t0 < 2.0, body
        error = assert_error(r, 400)
        if param is not None:
            assert error["param"] == param, (body, error)
    assert_error(
        await http.post(
            "/v1/score", json={"model": m, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}
        ),
        400,
        param="text_1",
    )
    assert_error(
        await http.post("/v1/rerank", json={"model": m, "query": "q", "documents": []}),
        400,
        param="documents",
    )
    assert_error(await http.post("/v1/embeddings", json={"model": "nope", "input": "a"}), 404)


async def test_models_say_an_embedding_model_only_embeds_and_scores(
    suite: Suite, http: httpx.AsyncClient
) -> None:
    """Detected from the checkpoint's sentence-transformers config (the served name says
    nothing): /v1/models lists embed and score, and generation is a 400 naming `model`."""
    listed = (await http.get("/v1/models")).json()
    validate_openai("ListModelsResponse", listed)
    (mine,) = [m for m in listed["data"] if m["id"] == suite.model]
    assert mine["capabilities"] == ["embed", "score"]
    messages = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": messages}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ]:
        r = await http.post(path, json={"model": suite.model, **body})
        assert_error(r, 400, param="model", contains="cannot serve text generation")
    r = await http.post(  # Anthropic's envelope
        "/v1/messages", json={"model": suite.model, "messages": messages, "max_tokens": 4}
    )
    assert r.status_code == 400 and "cannot serve text generation" in r.text, r.text


async def test_langchain_openai_embeddings(suite: Suite) -> None:
    """langchain-openai's OpenAIEmbeddings as its docs set it up for OpenAI-compatible servers
    (texts sent as they are: `check_embedding_ctx_length=False`, else it sends tiktoken ids)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    emb = langchain_openai.OpenAIEmbeddings(
        model=suite.model,
        base_url=f"{suite.url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    docs = await emb.aembed_documents(TEXTS)
    for text, vec in zip(TEXTS, docs, strict=True):
        close(vec, suite.expected(text))
    close(await emb.aembed_query(TEXTS[0]), suite.expected(TEXTS[0]))


async def test_llama_index_openai_embedding(suite: Suite) -> None:
    """llama-index's OpenAIEmbedding as its docs set it up for OpenAI-compatible servers
    (`model_name` any name, `api_base` the server's /v1), sync and async, documents and query."""
    llama_openai = pytest.importorskip("llama_index.embeddings.openai")
    emb = llama_openai.OpenAIEmbedding(
        model_name=suite.model, api_base=f"{suite.url}/v1", api_key="unused", max_retries=0
    )
    docs = await emb.aget_text_embedding_batch(TEXTS)
    for text, vec in zip(TEXTS, docs, strict=True):
        close(vec, suite.expected(text))
    close(await emb.aget_query_embedding(TEXTS[1]), suite.expected(TEXTS[1]))
    close(await asyncio.to_thread(emb.get_text_embedding, TEXTS[2]), suite.expected(TEXTS[2]))
