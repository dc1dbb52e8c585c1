"""The `openai-agents` SDK's default model (OpenAI's Responses API) running an agent that must
call a function tool, against a real gateway (fake tokenizer: a prompt "tools" calls
get_weather, a tool result is answered with "Hello world !")."""

from __future__ import annotations

from openai import AsyncOpenAI

from flotilla.services.gateway.service import GatewayService
from tests.gateway.fakes import FakeTokenizer


async def test_agent_calls_a_function_tool(gateway: GatewayService, model: str,
                                           tokenizer: FakeTokenizer) -> None:
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=model, openai_client=client))
    result = await Runner.run(agent, "tools", max_turns=4)
    assert seen == ["Paris"]
    assert result.final_output == "Hello world !"
    messages = tokenizer.requests[-1].messages
    assert messages is not None and messages[-1]["role"] == "tool"
    assert messages[-1]["content"] == "sunny in Paris"
