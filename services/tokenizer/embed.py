"""Tokenization for pooling requests (embeddings, score, rerank): `tokenizer_embed(model)`.

Rules:
- No chat template: a text input is tokenized as it is, with the special tokens the model adds
  to a bare text (`add_special_tokens`, default on: BOS, or the EOS that Qwen3-Embedding's
  tokenizer appends); a token-id input is taken as it is, each id inside the vocabulary
  (a 400 naming `input` otherwise).
- The inputs together may hold at most `max_total_tokens` (the gateway's
  `max_embedding_tokens`): a 400 before any engine work.
- `truncate_prompt_tokens` (vLLM's): keep each input's last n tokens (-1: the context length;
  more than the context is a 400). Without it, an input longer than the context is a 400
  `context_length_exceeded`, never silently cut.
- The token ids go to one engine as one PoolRequest (`engine_pool(model)`); its reply (vectors,
  or its error) is the reply. The request waits until its deadline (the gateway's), else
  `request_timeout_s`.
- `Embedder` is the plain core; `serve_embed` the NATS adapter (queue group `tokenizer`).
  Tokenizing runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.subscription import Subscription

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError, deadline_exceeded, invalid_request
from flotilla.libs.common.pooling_messages import EmbedRequest, PoolReply, PoolRequest
from flotilla.services.tokenizer.tokenizer import Tokenizer


class Embedder:
    """Turns an EmbedRequest's inputs into token ids; holds no per-request state."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    def token_ids(self, req: EmbedRequest) -> list[list[int]]:
        limit = self.max_model_len
        keep = req.truncate_prompt_tokens
        if keep == -1:
            keep = limit
        if keep is not None and not 1 <= keep <= limit:
            raise invalid_request(
                f"`truncate_prompt_tokens` must be -1 or in 1..{limit} (the context length)",
                param="truncate_prompt_tokens",
                code="invalid_value",
            )
        prompts = []
        for i, item in enumerate(req.inputs):
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            else:
                ids = item
                if not self.tokenizer.valid_ids(ids):
                    vocab = self.tokenizer.vocab_size
                    bad = next(t for t in ids if not 0 <= t < vocab)
                    raise invalid_request(
                        f"input {i} holds the token id {bad}, outside this model's vocabulary "
                        f"(0..{vocab - 1}).",
                        param="input",
                        code="invalid_value",
                    )
            if not ids:
                raise invalid_request(f"input {i} has no tokens", param="input")
            if keep is not None and len(ids) > keep:
                ids = ids[-keep:]
            if len(ids) > limit:
                raise invalid_request(
                    f"This model's maximum context length is {limit} tokens. However, input "
                    f"{i} has {len(ids)} tokens. Shorten it, or send `truncate_prompt_tokens`.",
                    param="input",
                    code="context_length_exceeded",
                )
            prompts.append(list(ids))
        total = sum(len(p) for p in prompts)
        if req.max_total_tokens is not None and total > req.max_total_tokens:
            raise invalid_request(
                f"The inputs hold {total} tokens together; this server takes at most "
                f"{req.max_total_tokens} in one request.",
                param="input",
                code="too_many_tokens",
            )
        return prompts


async def pool_on_engine(bus: Bus, pool: PoolRequest, request_timeout_s: float) -> PoolReply:
    """Ask the model's engines to pool `pool`, within its deadline (else `request_timeout_s`)."""
    timeout = request_timeout_s
    if pool.deadline is not None:
        timeout = pool.deadline - time.time()
        if timeout <= 0:
            raise deadline_exceeded("the request's deadline passed before the engine")
    return await bus.request(subjects.engine_pool(pool.model), pool, PoolReply, timeout)


async def serve_embed(
    bus: Bus, model: str, embedder: Embedder, request_timeout_s: float
) -> Subscription:
    """Serve `tokenizer_embed(model)`; errors become the reply's `error`."""

    async def embed(req: EmbedRequest) -> PoolReply:
        try:
            prompts = await asyncio.to_thread(embedder.token_ids, req)
            pool = PoolRequest(request_id=req.request_id, model=model, prompts=prompts,
                               pooling=req.pooling, priority=req.priority, deadline=req.deadline)
            return await pool_on_engine(bus, pool, request_timeout_s)
        except FlotillaError as exc:
            return PoolReply(error=exc.info)

    return await bus.serve(subjects.tokenizer_embed(model), EmbedRequest, embed, queue="tokenizer")
