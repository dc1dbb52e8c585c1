"""Pooling endpoints: `/v1/embeddings` (OpenAI's shape), `/v1/score` (vLLM's) and `/v1/rerank`,
`/rerank`, `/v2/rerank` (the Jina / Cohere shape vLLM serves).

Rules:
- Every body is validated against the spec (counts bounded by `max_embedding_inputs`); token-id
  inputs are counted here against `max_embedding_tokens`, text inputs by the tokenizer (both a
  400 before any engine work).
- One EmbedRequest per HTTP request goes to the model's tokenizer, which tokenizes (no chat
  template) and has one engine pool every input (prefill only); the reply carries the vectors
  as base64 float32, passed through for `encoding_format: base64`, decoded for `float`.
- Score and rerank send the pairs (a ScoreRequest) to the tokenizer, which scores them as the
  model wants (services/tokenizer/scoring.py): the cosine similarity of the two embeddings for
  an embedding model (vLLM's rule), P(yes) of Qwen3-Reranker's judging prompt for a reranker.
  Rerank orders the documents by it. `dimensions` and `normalize` apply to /v1/embeddings
  only.
- A client that disconnects while its request runs gets it cancelled: a Cancel broadcast, on
  which the engine aborts the request's pooling jobs.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common import subjects
from flotilla.libs.common.deadline import Deadline
from flotilla.libs.common.errors import FlotillaError, internal, invalid_request
from flotilla.libs.common.messages import Cancel
from flotilla.libs.common.pooling_messages import (
    EmbedRequest,
    PoolingOptions,
    PoolReply,
    ScoreReply,
    ScoreRequest,
)
from flotilla.services.gateway.plan import new_request_id
from flotilla.services.gateway.request_body import gateway, model_request, request_deadline
from flotilla.services.gateway.routes import CLIENT_CLOSED, ClientGone, unless_disconnected

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState

log = logging.getLogger(__name__)
R = TypeVar("R", PoolReply, ScoreReply)
router = APIRouter()


def embedding_inputs(value: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four input forms as a list of inputs (a string or a list of token ids each)."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [value]
    return list(value)


def _check_token_ids(gw: GatewayState, inputs: list[str | list[int]]) -> None:
    total = sum(len(i) for i in inputs if isinstance(i, list))
    limit = gw.settings.max_embedding_tokens
    if total > limit:
        raise invalid_request(
            f"The inputs hold {total} tokens together; this server takes at most {limit} in one "
            "request.",
            param="input",
            code="too_many_tokens",
        )


class _PoolCancel:
    """Cancels one pooling request when its client leaves (see unless_disconnected)."""

    def __init__(self, gw: GatewayState, request_id: str) -> None:
        self.gw, self.request_id = gw, request_id

    def cancel(self, reason: str = "client_disconnect") -> None:
        self.gw.bus.spawn(self._publish())

    async def _publish(self) -> None:
        try:
            await self.gw.bus.publish(
                subjects.CANCEL, Cancel(request_id=self.request_id, reason="client_disconnect")
            )
        except Exception as exc:  # connection closing: the engine finishes the work unseen
            log.warning("cannot publish cancel for %s: %s", self.request_id, exc)

    def close(self) -> None:
        return None


def _common(gw: GatewayState, body: dict[str, Any], deadline: Deadline) -> dict[str, Any]:
    """The fields every pooling request to the tokenizer carries, from the body."""
    add = body.get("add_special_tokens")
    return dict(
        request_id=new_request_id(),
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        add_special_tokens=add is None or bool(add),
        max_total_tokens=gw.settings.max_embedding_tokens,
        priority=body.get("priority") or 0,
        deadline=deadline.at,
    )


async def _ask(
    request: Request,
    gw: GatewayState,
    subject: str,
    msg: Any,
    reply_cls: type[R],
    deadline: Deadline,
) -> R:
    """The tokenizer's reply (its error raised); ClientGone if the client left meanwhile."""
    remaining = deadline.remaining()
    if remaining <= 0:
        raise deadline.error()
    asked = gw.bus.request(subject, msg, reply_cls, timeout=remaining)
    reply = await unless_disconnected(request, asked, _PoolCancel(gw, msg.request_id))
    if reply.error is not None:
        raise FlotillaError(reply.error)
    return reply


async def embed(
    request: Request,
    gw: GatewayState,
    model: str,
    inputs: list[str | list[int]],
    body: dict[str, Any],
    pooling: PoolingOptions,
    deadline: Deadline,
) -> PoolReply:
    """The vectors of `inputs` from the model's tokenizer and an engine (see module rules)."""
    _check_token_ids(gw, inputs)
    req = EmbedRequest(model=model, inputs=inputs, pooling=pooling, **_common(gw, body, deadline))
    reply = await _ask(request, gw, subjects.tokenizer_embed(model), req, PoolReply, deadline)
    if len(reply.embeddings) != len(inputs):
        raise internal(
            f"the engine answered {len(reply.embeddings)} vectors for {len(inputs)} inputs"
        )
    return reply


async def score(
    request: Request,
    gw: GatewayState,
    model: str,
    queries: list[str],
    documents: list[str],
    body: dict[str, Any],
    deadline: Deadline,
) -> ScoreReply:
    """The score of each pair (queries[i], documents[i]) (see module rules)."""
    req = ScoreRequest(
        model=model, queries=queries, documents=documents, **_common(gw, body, deadline)
    )
    reply = await _ask(request, gw, subjects.tokenizer_score(model), req, ScoreReply, deadline)
    if len(reply.scores) != len(queries):
        raise internal(
            f"the tokenizer answered {len(reply.scores)} scores for {len(queries)} pairs"
        )
    return reply


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


@router.post("/v1/embeddings")
async def create_embedding(request: Request) -> Response:
    gw = gateway(request)
    deadline = request_deadline(request)
    body, info = await model_request(request, "createEmbedding", "embed", deadline)
    inputs = embedding_inputs(body["input"])
    normalize = body.get("normalize")
    pooling = PoolingOptions(
        normalize=normalize is None or bool(normalize), dimensions=body.get("dimensions")
    )
    try:
        reply = await embed(request, gw, info.id, inputs, body, pooling, deadline)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    as_base64 = body.get("encoding_format") == "base64"
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": e
            if as_base64
            else np.frombuffer(base64.b64decode(e), dtype="<f4").tolist(),
        }
        for i, e in enumerate(reply.embeddings)
    ]
    return JSONResponse(
        {
            "id": f"embd-{new_request_id()}",
            "object": "list",
            "created": int(time.time()),
            "model": info.id,
            "data": data,
            "usage": _usage(reply.prompt_tokens),
        }
    )


def _score_pairs(text_1: list[str], text_2: list[str]) -> list[tuple[int, int]]:
    """vLLM's pairing: one text_1 against each text_2, or text_1[i] against text_2[i]."""
    if len(text_1) == 1:
        return [(0, j) for j in range(len(text_2))]
    if len(text_1) == len(text_2):
        return [(i, i) for i in range(len(text_1))]
    raise invalid_request(
        f"`text_1` holds {len(text_1)} texts and `text_2` {len(text_2)}: send one text_1, or "
        "as many as text_2.",
        param="text_1",
    )


@router.post("/v1/score")
async def create_score(request: Request) -> Response:
    gw = gateway(request)
    deadline = request_deadline(request)
    body, info = await model_request(request, "createScore", "score", deadline)
    text_1 = [body["text_1"]] if isinstance(body["text_1"], str) else body["text_1"]
    text_2 = [body["text_2"]] if isinstance(body["text_2"], str) else body["text_2"]
    pairs = _score_pairs(text_1, text_2)
    try:
        reply = await score(
            request,
            gw,
            info.id,
            [text_1[i] for i, _ in pairs],
            [text_2[j] for _, j in pairs],
            body,
            deadline,
        )
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    data = [{"index": k, "object": "score", "score": s} for k, s in enumerate(reply.scores)]
    return JSONResponse(
        {
            "id": f"score-{new_request_id()}",
            "object": "list",
            "created": int(time.time()),
            "model": info.id,
            "data": data,
            "usage": _usage(reply.prompt_tokens),
        }
    )


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(request: Request) -> Response:
    gw = gateway(request)
    deadline = request_deadline(request)
    body, info = await model_request(request, "createRerank", "score", deadline)
    documents = [d if isinstance(d, str) else d["text"] for d in body["documents"]]
    try:
        reply = await score(
            request, gw, info.id, [body["query"]] * len(documents), documents, body, deadline
        )
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    scores = reply.scores
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    top_n = body.get("top_n") or len(documents)
    with_documents = body.get("return_documents") is not False
    results = [
        {
            "index": i,
            "relevance_score": float(scores[i]),
            **({"document": {"text": documents[i]}} if with_documents else {}),
        }
        for i in order[:top_n]
    ]
    return JSONResponse(
        {
            "id": f"rerank-{new_request_id()}",
            "model": info.id,
            "usage": {"total_tokens": reply.prompt_tokens},
            "results": results,
        }
    )
