"""/v1/score and /v1/rerank on a reranker: a tiny random Qwen3 whose model card says
`pipeline_tag: text-ranking` as Qwen3-Reranker's does (neither its served name nor its directory
says reranker: the checkpoint's evidence decides), scored as Qwen3-Reranker's model card does
(its judging prompt, P(yes) from the last token's "yes" and "no" logits). The reference is the
card's code on transformers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import torch

from flotilla.services.tokenizer.scoring import (
    QWEN3_RERANKER_PREFIX,
    QWEN3_RERANKER_SUFFIX,
    qwen3_reranker_content,
)
from tests.pooling.models import save_tiny_qwen3
from tests.pooling.suite import served

QWEN3_RERANKER_CARD = (  # the front matter of Qwen3-Reranker-0.6B's README.md
    "---\nlicense: apache-2.0\nbase_model:\n- Qwen/Qwen3-0.6B-Base\n"
    "library_name: transformers\npipeline_tag: text-ranking\n---\n# Qwen3-Reranker-0.6B\n"
)
QUERY = "where is paris"
DOCS = ["paris is the capital of france", "a cat sat on the mat", "the weather is sunny today"]


class Reference:
    """Qwen3-Reranker's model-card scoring on transformers."""

    def __init__(self, path: Any, hf: Any) -> None:
        from transformers import AutoTokenizer

        self.tok, self.hf = AutoTokenizer.from_pretrained(path), hf
        self.yes, self.no = self.tok.convert_tokens_to_ids(["yes", "no"])

    def ids(self, query: str, doc: str, max_length: int | None = None) -> list[int]:
        prefix = self.tok(QWEN3_RERANKER_PREFIX, add_special_tokens=False)["input_ids"]
        suffix = self.tok(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)["input_ids"]
        content = self.tok(qwen3_reranker_content(query, doc), add_special_tokens=False)[
            "input_ids"
        ]
        if max_length is not None:
            content = content[: max_length - len(prefix) - len(suffix)]
        return prefix + content + suffix

    def score(self, query: str, doc: str, max_length: int | None = None) -> float:
        with torch.no_grad():
            ids = torch.tensor([self.ids(query, doc, max_length)])
            logits = self.hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
        pair = torch.stack([logits[self.no], logits[self.yes]])
        return float(torch.softmax(pair, dim=0)[1])


@pytest.fixture(scope="module")
async def reranker(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[str, str, Reference]]:
    path = tmp_path_factory.mktemp("qwen3-judge")
    hf = save_tiny_qwen3(path, tokenizer=True, max_position_embeddings=1024)
    (path / "README.md").write_text(QWEN3_RERANKER_CARD)
    model = f"tiny-qwen3-judge-{uuid.uuid4().hex[:8]}"
    async with served(path, model) as url:
        yield url, model, Reference(path, hf)


async def test_rerank_and_score_are_the_model_cards_p_yes(reranker) -> None:  # type: ignore[no-untyped-def]
    url, model, ref = reranker
    want = [ref.score(QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post("/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [want[i] for i in order], abs=1e-4
        )
        r = await http.post("/v1/score", json={"model": model, "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(ref.ids(QUERY, d)) for d in DOCS)
        # truncation cuts the pair's text, never the instructions around it
        n = len(ref.ids(QUERY, DOCS[0])) - 5
        r = await http.post(
            "/v1/score",
            json={"model": model, "text_1": QUERY, "text_2": DOCS[0], "truncate_prompt_tokens": n},
        )
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["score"] == pytest.approx(ref.score(QUERY, DOCS[0], n), abs=1e-4)
        r = await http.post(
            "/v1/rerank", json={"model": model, "query": QUERY, "documents": ["paris " * 400]}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_models_say_a_reranker_scores_and_generates_but_does_not_embed(reranker) -> None:  # type: ignore[no-untyped-def]
    url, model, _ = reranker
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        (mine,) = [m for m in (await http.get("/v1/models")).json()["data"] if m["id"] == model]
        assert mine["capabilities"] == ["generate", "score"]
        r = await http.post("/v1/embeddings", json={"model": model, "input": "paris"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model"
        assert "cannot serve embeddings" in r.json()["error"]["message"]
