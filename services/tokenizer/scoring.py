"""Scores of text pairs for /v1/score and /v1/rerank: `tokenizer_score(model)`.

Rules:
- An embedding model (the default): every distinct text is embedded once (pooled and
  L2-normalized by the engine, embed.py's tokenization) and a pair's score is the cosine
  similarity of its two vectors, which is what vLLM does for embedding models.
- A Qwen3-Reranker (`FLOTILLA_SCORE_MODE=qwen3_reranker`, or `auto` where the checkpoint is
  a reranker — its files say so, else its name says "reranker", model_capabilities.py — and
  "yes" and "no" are single tokens): each pair becomes the model card's judging
  prompt (its system prompt, `<Instruct>`, `<Query>`, `<Document>`, the empty think block),
  tokenized in three parts without special tokens as the card does, and the engine returns the
  last token's "no" and "yes" logits; the score is P(yes) = sigmoid(yes - no).
  `truncate_prompt_tokens` bounds the whole prompt by cutting the pair's text (the card's
  `max_length`), never the instructions around it.
- Errors are the reply's `error`; the engine's own (400s, 503s, 504) pass through.
"""

from __future__ import annotations

import asyncio
import base64
import math
from typing import Literal

import numpy as np
from nats.aio.subscription import Subscription

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError, invalid_request
from flotilla.libs.common.model_capabilities import ModelKind
from flotilla.libs.common.pooling_messages import (
    EmbedRequest,
    PoolingOptions,
    PoolReply,
    PoolRequest,
    ScoreReply,
    ScoreRequest,
)
from flotilla.services.tokenizer.embed import Embedder, pool_on_engine
from flotilla.services.tokenizer.tokenizer import Tokenizer

ScoreMode = Literal["embedding", "qwen3_reranker"]

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)


def qwen3_reranker_content(query: str, document: str) -> str:
    return f"<Instruct>: {QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


def _single_token(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def score_mode(setting: str, tokenizer: Tokenizer, kind: ModelKind) -> ScoreMode:
    """The mode the setting asks for; `auto`: qwen3_reranker where the checkpoint is a
    reranker (model_capabilities.py: its files, else its name) and "yes" / "no" are single
    tokens, else embedding."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    yes, no = _single_token(tokenizer, "yes"), _single_token(tokenizer, "no")
    if yes is not None and no is not None and kind == "rerank":
        return "qwen3_reranker"
    return "embedding"


class Scorer:
    """Turns ScoreRequests into engine pooling requests and their replies into scores."""

    def __init__(self, embedder: Embedder, mode: ScoreMode) -> None:
        self.embedder, self.mode = embedder, mode
        tokenizer = embedder.tokenizer
        if mode == "qwen3_reranker":
            yes, no = _single_token(tokenizer, "yes"), _single_token(tokenizer, "no")
            if yes is None or no is None:
                raise ValueError("score mode qwen3_reranker needs single-token 'yes' and 'no'")
            self.no_yes = [no, yes]
            self.prefix = tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
            self.suffix = tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)

    def prompts(self, req: ScoreRequest) -> tuple[list[list[int]], PoolingOptions]:
        """Token ids for the engine and how it pools them (see the module rules)."""
        if self.mode == "embedding":
            texts = list(dict.fromkeys([*req.queries, *req.documents]))
            embed = EmbedRequest(
                request_id=req.request_id,
                model=req.model,
                inputs=list(texts),
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                add_special_tokens=req.add_special_tokens,
                max_total_tokens=req.max_total_tokens,
            )
            return self.embedder.token_ids(embed), PoolingOptions()
        tokenizer, limit = self.embedder.tokenizer, self.embedder.max_model_len
        keep = limit if req.truncate_prompt_tokens in (None, -1) else req.truncate_prompt_tokens
        room = min(keep, limit) - len(self.prefix) - len(self.suffix)
        if room < 1:
            raise invalid_request(
                f"`truncate_prompt_tokens` must leave room for the reranker's "
                f"{len(self.prefix) + len(self.suffix)}-token instructions",
                param="truncate_prompt_tokens",
            )
        prompts = []
        for i, (query, document) in enumerate(zip(req.queries, req.documents, strict=True)):
            content = tokenizer.encode(
                qwen3_reranker_content(query, document), add_special_tokens=False
            )
            if len(content) > room and req.truncate_prompt_tokens is None:
                raise invalid_request(
                    f"This model's maximum context length is {limit} tokens. However, pair {i} "
                    f"needs {len(content) + len(self.prefix) + len(self.suffix)}. Shorten it, or "
                    "send `truncate_prompt_tokens`.",
                    param="documents",
                    code="context_length_exceeded",
                )
            prompts.append(self.prefix + content[:room] + self.suffix)
        total = sum(len(p) for p in prompts)
        if req.max_total_tokens is not None and total > req.max_total_tokens:
            raise invalid_request(
                f"The pairs hold {total} tokens together; this server takes at most "
                f"{req.max_total_tokens} in one request.",
                param="documents",
                code="too_many_tokens",
            )
        return prompts, PoolingOptions(normalize=False, logit_ids=self.no_yes)

    def scores(self, req: ScoreRequest, reply: PoolReply) -> list[float]:
        vectors = [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in reply.embeddings]
        if self.mode == "qwen3_reranker":
            return [1.0 / (1.0 + math.exp(float(no - yes))) for no, yes in vectors]
        texts = list(dict.fromkeys([*req.queries, *req.documents]))
        index = {t: vectors[i] for i, t in enumerate(texts)}
        return [float(index[q] @ index[d]) for q, d in zip(req.queries, req.documents, strict=True)]


async def serve_score(
    bus: Bus, model: str, scorer: Scorer, request_timeout_s: float
) -> Subscription:
    """Serve `tokenizer_score(model)`; errors become the reply's `error`."""

    async def score(req: ScoreRequest) -> ScoreReply:
        try:
            prompts, pooling = await asyncio.to_thread(scorer.prompts, req)
            pool = PoolRequest(request_id=req.request_id, model=model, prompts=prompts,
                               pooling=pooling, priority=req.priority, deadline=req.deadline)
            reply = await pool_on_engine(bus, pool, request_timeout_s)
            if reply.error is not None:
                return ScoreReply(error=reply.error)
            return ScoreReply(scores=scorer.scores(req, reply), prompt_tokens=reply.prompt_tokens)
        except FlotillaError as exc:
            return ScoreReply(error=exc.info)

    return await bus.serve(subjects.tokenizer_score(model), ScoreRequest, score, queue="tokenizer")
