"""langchain-openai's `ChatOpenAI` against the gateway: a structured-output call, a tool call,
and the resulting AI messages sent back as history, in the shapes LangChain writes them."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from flotilla.services.gateway.service import GatewayService
from tests.gateway.fakes import FakeTokenizer

langchain_openai = pytest.importorskip("langchain_openai")
messages_mod = pytest.importorskip("langchain_core.messages")


class Answer(BaseModel):
    a: int


class get_weather(BaseModel):  # noqa: N801 - the tool's name as the fake tokenizer calls it
    """The weather in a city."""

    city: str


@pytest.fixture
def llm(gateway: GatewayService, model: str):  # type: ignore[no-untyped-def]
    return langchain_openai.ChatOpenAI(model=model, base_url=gateway.url + "/v1",
                                       api_key="unused", max_retries=0)


async def test_structured_output_then_history(llm, tokenizer: FakeTokenizer) -> None:  # type: ignore[no-untyped-def]
    structured = llm.with_structured_output(Answer, method="json_schema", include_raw=True)
    out = await structured.ainvoke("json")
    assert out["parsed"] == Answer(a=1)
    history = [messages_mod.HumanMessage("json"), out["raw"], messages_mod.HumanMessage("again")]
    reply = await llm.ainvoke(history)
    assert reply.content == "Hello world !"
    sent = tokenizer.requests[-1].messages
    assert sent is not None and sent[1] == {"role": "assistant", "content": '{"a": 1}'}


async def test_tool_call_then_history(llm, tokenizer: FakeTokenizer) -> None:  # type: ignore[no-untyped-def]
    with_tools = llm.bind_tools([get_weather])
    ai = await with_tools.ainvoke("tools")
    assert ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"] == {"city": "Paris"}
    history = [messages_mod.HumanMessage("tools"), ai,
               messages_mod.ToolMessage("sunny", tool_call_id=ai.tool_calls[0]["id"]),
               messages_mod.HumanMessage("thanks")]
    reply = await with_tools.ainvoke(history)
    assert reply.content == "Hello world !"
    sent = tokenizer.requests[-1].messages
    assert sent is not None and sent[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = [c async for c in with_tools.astream("tools")]
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.tool_calls[0]["args"] == {"city": "Paris"}
    reply = await with_tools.ainvoke([messages_mod.HumanMessage("tools"), merged,
                                      messages_mod.ToolMessage("sunny", tool_call_id="call_1")])
    assert reply.content == "Hello world !"
