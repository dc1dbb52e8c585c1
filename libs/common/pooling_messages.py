"""Typed messages of the pooling subjects (embeddings, score, rerank): see subjects.py.

gateway -> tokenizer: `EmbedRequest` on `tokenizer_embed(model)`; the tokenizer tokenizes every
input (no chat template) and asks an engine with `PoolRequest` on `engine_pool(model)`; both
reply `PoolReply`. Score and rerank: `ScoreRequest` on `tokenizer_score(model)` -> `ScoreReply`;
the tokenizer scores each pair as its model wants (services/tokenizer/scoring.py). Vectors
travel as base64 of little-endian float32 (what OpenAI's `encoding_format: base64` sends), a
quarter of their JSON size; the bus splits a large reply into parts (libs/common/bus_parts.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flotilla.libs.common.messages import ErrorInfo, Message

PoolingMethod = Literal["last", "mean", "cls"]


class PoolingOptions(BaseModel):
    """How one input's hidden states become its vector. `method` None = the model's own
    (sentence-transformers config, else last-token for decoder models). `dimensions`: keep the
    first n values (Matryoshka) before normalizing. `normalize`: L2-normalize (default on, as
    sentence-transformers' Normalize module and vLLM's embedding pooler do). `logit_ids`: the
    vector is instead the LM head's logits of these token ids at the last token (a reranker
    that answers yes / no, as Qwen3-Reranker does)."""

    model_config = ConfigDict(extra="forbid")
    method: PoolingMethod | None = None
    normalize: bool = True
    dimensions: int | None = None
    logit_ids: list[int] | None = None


class EmbedRequest(Message):
    """Inputs to embed, each a text or a list of token ids, already validated by the gateway.
    `truncate_prompt_tokens`: keep each input's last n tokens (vLLM's; -1 = the context length);
    None = an input longer than the context is a 400."""

    request_id: str
    model: str
    inputs: list[str | list[int]]
    pooling: PoolingOptions = Field(default_factory=PoolingOptions)
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    max_total_tokens: int | None = None  # the inputs' tokens together; more is a 400
    priority: int = 0
    deadline: float | None = None


class PoolRequest(Message):
    """Token ids of each input, for one engine to pool (prefill only, nothing generated)."""

    request_id: str
    model: str
    prompts: list[list[int]]
    pooling: PoolingOptions = Field(default_factory=PoolingOptions)
    priority: int = 0
    deadline: float | None = None


class PoolReply(Message):
    """One vector per input, in order (base64 of little-endian float32), and the tokens read."""

    embeddings: list[str] = Field(default_factory=list)
    prompt_tokens: int = 0
    error: ErrorInfo | None = None


class ScoreRequest(Message):
    """Pairs to score (`queries[i]` against `documents[i]`), already validated by the gateway;
    the other fields as in EmbedRequest."""

    request_id: str
    model: str
    queries: list[str]
    documents: list[str]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    max_total_tokens: int | None = None
    priority: int = 0
    deadline: float | None = None


class ScoreReply(Message):
    """One score per pair, in order (cosine similarity, or a reranker's probability of yes)."""

    scores: list[float] = Field(default_factory=list)
    prompt_tokens: int = 0
    error: ErrorInfo | None = None
