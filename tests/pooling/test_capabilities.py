"""A generative checkpoint (a tiny random Qwen3 with no embedding or reranker mark) serves
everything: /v1/models says so, and embeddings share its engine with generation."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.gateway.schemas import validate_openai
from tests.pooling.models import save_tiny_qwen3
from tests.pooling.suite import served
from tests.pooling.test_endpoints import TEXTS, Suite, close


@pytest.fixture(scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Suite]:
    path = tmp_path_factory.mktemp("qwen3-causal")
    hf = save_tiny_qwen3(path, tokenizer=True)
    model = f"gen-{uuid.uuid4().hex[:8]}"
    async with served(path, model) as url:
        yield Suite(path, model, hf, url)


async def test_models_say_a_generative_model_serves_everything(suite: Suite) -> None:
    async with httpx.AsyncClient(base_url=suite.url, timeout=30) as http:
        r = await http.get(f"/v1/models/{suite.model}")
    assert r.status_code == 200, r.text
    validate_openai("Model", r.json())
    assert r.json()["capabilities"] == ["generate", "embed", "score"]


async def test_embeddings_share_the_engine_with_generation(suite: Suite) -> None:
    """Completions and embeddings (64 inputs each) at once, on an engine whose generation
    queue holds 8 requests: everything finishes, the vectors unchanged."""
    many = [TEXTS[i % len(TEXTS)] for i in range(64)]
    async with openai.AsyncOpenAI(
        base_url=f"{suite.url}/v1", api_key="unused", max_retries=0
    ) as sdk:
        gens = [
            asyncio.ensure_future(
                sdk.completions.create(model=suite.model, prompt=[5, 6, i], max_tokens=16)
            )
            for i in range(6)
        ]
        embs = await asyncio.gather(
            *(
                sdk.embeddings.create(model=suite.model, input=many, encoding_format="float")
                for _ in range(3)
            )
        )
        for done in await asyncio.gather(*gens):
            assert done.usage is not None and done.usage.completion_tokens >= 1
        for r in embs:
            for text, item in zip(many, r.data, strict=True):
                close(item.embedding, suite.expected(text))  # last-token pooling
