"""Plain tokenization and detokenization (/tokenize, /detokenize) with the real SmolLM2
tokenizer, against transformers' own tokenizer for the same GGUF, and served on the bus by the
tokenizer service."""

from __future__ import annotations

from typing import Any

import pytest

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import DecodeReply, DecodeRequest, EncodeReply, EncodeRequest
from flotilla.services.tokenizer.service import TokenizerService
from flotilla.services.tokenizer.token_codec import TokenCodec
from flotilla.services.tokenizer.tokenizer import Tokenizer

TEXTS = ["Hello world", "  two  spaces\nand a newline", "naïve café ☕ 你好",
         "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module")
def codec(smollm2: Tokenizer) -> TokenCodec:
    return TokenCodec(smollm2, 2048)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_encode_matches_transformers(codec: TokenCodec, hf_reference: Any, text: str,
                                     special: bool) -> None:
    reply = codec.encode(EncodeRequest(model="m", text=text, add_special_tokens=special,
                                       token_strs=True))
    assert reply.token_ids == hf_reference.encode(text, add_special_tokens=special)
    assert reply.token_strs == hf_reference.convert_ids_to_tokens(reply.token_ids)
    assert reply.max_model_len == 2048
    plain = codec.encode(EncodeRequest(model="m", text=text, add_special_tokens=special))
    assert plain.token_ids == reply.token_ids and plain.token_strs is None


@pytest.mark.parametrize("text", TEXTS)
def test_decode_keeps_special_tokens_as_transformers(codec: TokenCodec, hf_reference: Any,
                                                     text: str) -> None:
    ids = hf_reference.encode(text, add_special_tokens=False)
    assert codec.decode(DecodeRequest(model="m", token_ids=ids)).text == \
        hf_reference.decode(ids, skip_special_tokens=False)


def test_decode_refuses_ids_outside_the_vocabulary(codec: TokenCodec,
                                                   smollm2: Tokenizer) -> None:
    with pytest.raises(FlotillaError) as err:
        codec.decode(DecodeRequest(model="m", token_ids=[1, smollm2.vocab_size]))
    assert err.value.status == 400 and err.value.info.param == "tokens"
    assert str(smollm2.vocab_size) in err.value.info.message


async def test_the_service_serves_encode_and_decode(
        bus: Bus, service: TokenizerService,  # noqa: F811 - the imported fixture
        hf_reference: Any) -> None:
    reply = await bus.request(subjects.tokenizer_encode(service.model),
                              EncodeRequest(model=service.model, text="Hello world",
                                            token_strs=True), EncodeReply, timeout=5)
    assert reply.error is None
    assert reply.token_ids == hf_reference.encode("Hello world", add_special_tokens=True)
    decoded = await bus.request(subjects.tokenizer_decode(service.model),
                                DecodeRequest(model=service.model, token_ids=reply.token_ids),
                                DecodeReply, timeout=5)
    assert decoded.text == hf_reference.decode(reply.token_ids, skip_special_tokens=False)
    bad = await bus.request(subjects.tokenizer_decode(service.model),
                            DecodeRequest(model=service.model, token_ids=[10**9]),
                            DecodeReply, timeout=5)
    assert bad.error is not None and bad.error.status == 400 and bad.error.param == "tokens"
