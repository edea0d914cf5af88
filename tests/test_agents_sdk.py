"""The openai-agents SDK, unchanged, against `phasewise serve`: an Agent with one function tool runs to
a final output over /v1/responses (collected and streamed), its tool called with the model's arguments."""

from __future__ import annotations

import asyncio

import pytest

agents = pytest.importorskip("agents")
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled  # noqa: E402
from agents.models.openai_responses import OpenAIResponsesModel  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

pytestmark = pytest.mark.slow


def weather_agent(server, calls: list[str]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    return Agent(name="weather", instructions="Use your tools, then answer in one short sentence.", tools=[get_weather],
                 model=OpenAIResponsesModel(model="qwen", openai_client=client),
                 model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="required"))


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_agent_calls_its_tool_and_answers(qwen_server, streamed):
    """tool_choice "required" makes the first turn a call (the SDK resets it to auto after), so the
    second turn reads the tool's result and answers."""
    calls: list[str] = []
    agent = weather_agent(qwen_server, calls)

    async def run():
        if not streamed:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert calls and "paris" in calls[0].lower()
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
