"""The official `openai` client drives the gateway: what it parses is what users get."""

from __future__ import annotations

import openai
import pytest

from flotilla.services.gateway.service import GatewayService


@pytest.fixture
def oai(gateway: GatewayService) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


async def test_chat_and_stream(oai: openai.AsyncOpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    reply = await oai.chat.completions.create(model=model, messages=messages, n=2)  # type: ignore[arg-type]
    assert [c.message.content for c in reply.choices] == ["Hello world !"] * 2
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 2
    stream = await oai.chat.completions.create(model=model, messages=messages, stream=True,  # type: ignore[arg-type]
                                               stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == "Hello world !" and usage is not None and usage.total_tokens == 10


async def test_completions_and_models(oai: openai.AsyncOpenAI, model: str) -> None:
    reply = await oai.completions.create(model=model, prompt="x", max_tokens=3)
    assert reply.choices[0].text == "Hello world !"
    models = [m.id async for m in oai.models.list()]
    assert model in models
    assert (await oai.models.retrieve(model)).id == model


async def test_errors_map_to_client_exceptions(oai: openai.AsyncOpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],  # type: ignore[arg-type]
                                          verbosity="low")
    assert "verbosity" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(model="no-such-model",
                                          messages=[{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    with pytest.raises(openai.APIError) as refused:  # refused after admission starts: still 400
        await oai.chat.completions.create(model=model, stream=True,
                                          messages=[{"role": "user", "content": "refuse"}])  # type: ignore[arg-type]
    assert "maximum context length" in str(refused.value)
