"""Plain tokenization and detokenization for `/tokenize` and `/detokenize` (vLLM's shapes).

Rules:
- encode: the text as it is (no chat template, no context-length check); `add_special_tokens`
  adds what the model adds to a bare prompt (BOS, where it asks for one); `token_strs` are the
  vocabulary strings of the ids (`Ġworld`, as `convert_ids_to_tokens` gives them).
- decode: every id, special tokens included (vLLM's /detokenize decodes without skipping them);
  an id outside the vocabulary is a 400 naming `tokens`, never an empty string.
- `TokenCodec` is the plain core; `serve_token_codec` the NATS adapter (both subjects in the
  `tokenizer` queue group). Tokenizing a long text takes milliseconds, so it runs in a worker
  thread, off the event loop.
"""

from __future__ import annotations

import asyncio

from nats.aio.subscription import Subscription

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError, invalid_request
from flotilla.libs.common.messages import DecodeReply, DecodeRequest, EncodeReply, EncodeRequest
from flotilla.services.tokenizer.tokenizer import Tokenizer


class TokenCodec:
    """Encode/decode requests of one model's tokenizer; holds no per-request state."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    def token_strs(self, ids: list[int]) -> list[str]:
        backend = self.tokenizer.backend
        return [backend.id_to_token(i) or self.tokenizer.token_text(i) for i in ids]

    def encode(self, req: EncodeRequest) -> EncodeReply:
        ids = self.tokenizer.encode(req.text, add_special_tokens=req.add_special_tokens)
        return EncodeReply(token_ids=ids, token_strs=self.token_strs(ids) if req.token_strs
                           else None, max_model_len=self.max_model_len)

    def decode(self, req: DecodeRequest) -> DecodeReply:
        if not self.tokenizer.valid_ids(req.token_ids):
            bad = next(i for i in req.token_ids if not 0 <= i < self.tokenizer.vocab_size)
            raise invalid_request(
                f"`tokens` holds the id {bad}, outside this model's vocabulary "
                f"(0..{self.tokenizer.vocab_size - 1}).", param="tokens", code="invalid_value")
        return DecodeReply(text=self.tokenizer.decode(req.token_ids, skip_special_tokens=False))


async def serve_token_codec(bus: Bus, model: str, codec: TokenCodec) -> list[Subscription]:
    """Serve `tokenizer_encode(model)` and `tokenizer_decode(model)`; errors become the reply's
    `error`, so the gateway answers them in the envelope."""

    async def encode(req: EncodeRequest) -> EncodeReply:
        try:
            return await asyncio.to_thread(codec.encode, req)
        except FlotillaError as exc:
            return EncodeReply(error=exc.info)

    async def decode(req: DecodeRequest) -> DecodeReply:
        try:
            return await asyncio.to_thread(codec.decode, req)
        except FlotillaError as exc:
            return DecodeReply(error=exc.info)

    return [await bus.serve(subjects.tokenizer_encode(model), EncodeRequest, encode,
                            queue="tokenizer"),
            await bus.serve(subjects.tokenizer_decode(model), DecodeRequest, decode,
                            queue="tokenizer")]
