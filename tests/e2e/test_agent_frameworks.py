"""Agent frameworks against render-serve with its default flags (`make serve`): LangChain,
the OpenAI Agents SDK and pydantic-ai each run a tool round trip through their own code.

A 135M model does not choose a tool by itself, so each run forces the first call the way
its framework lets a user (a named or required tool choice) and leaves the rest to the
framework: the tool runs, its result goes back as the framework sends it, and the model's
answer ends the run. What each one sends differs (streamed or not, `strict` schemas,
`parallel_tool_calls`, `max_completion_tokens`, named or "required" choices), which is
the point. The frameworks are imported inside the tests: together they take seconds to
import, which a run that deselects these tests should not pay.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from openai import AsyncOpenAI

from tests.helpers.processes import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the weather in Paris?"
CALL_TOKENS = 28  # one forced call takes about 18
ANSWER_TOKENS = 12  # the final answer only has to start


def get_weather(city: Literal["Paris", "London"]) -> str:
    """Current weather of a city."""
    return f"It is sunny in {city}."


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frameworks' tracing and telemetry stay off: the tests talk to loopback only."""
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")


def _async_client(render: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{render.base_url}/v1", api_key="unused", max_retries=0)


def test_langchain_bind_tools_round_trip(render: ServerProcess) -> None:
    from langchain_core.messages import AIMessageChunk, HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)
    llm = ChatOpenAI(
        model=MODEL, base_url=f"{render.base_url}/v1", api_key="unused",
        temperature=0, max_retries=0,
    )  # fmt: skip
    forced = llm.bind_tools(
        [weather], tool_choice="get_weather", strict=True, max_tokens=CALL_TOKENS
    )
    messages: list[Any] = [HumanMessage(ASK)]
    chunks = list(forced.stream(messages))  # the call streamed, put back together
    call_message = sum(chunks[1:], chunks[0])
    assert isinstance(call_message, AIMessageChunk)
    [call] = call_message.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    messages += [call_message, weather.invoke(call)]
    answer = llm.bind_tools([weather], max_tokens=ANSWER_TOKENS).invoke(messages)
    assert answer.content
    assert not answer.tool_calls


def test_openai_agents_function_tool(render: ServerProcess) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[function_tool(get_weather)],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=_async_client(render)),
        # "required" holds for the first turn only (reset_tool_choice): the second answers.
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=CALL_TOKENS,
        ),  # fmt: skip
    )

    async def run() -> Any:
        result = Runner.run_streamed(agent, ASK, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.new_items[1].output == "It is sunny in Paris."
    assert result.final_output


def test_pydantic_ai_tool(render: ServerProcess) -> None:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    def settings(ctx: RunContext[None]) -> ModelSettings:
        # pydantic-ai's way to force a tool on one step: per-step settings.
        if ctx.run_step == 1:
            return {
                "tool_choice": ["get_weather"],
                "parallel_tool_calls": False,
                "max_tokens": CALL_TOKENS,
                "temperature": 0,
            }
        return {"max_tokens": ANSWER_TOKENS, "temperature": 0}

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=_async_client(render)))
    agent = Agent(model, tools=[get_weather], model_settings=settings)
    result = asyncio.run(agent.run(ASK))
    returns = [
        part.content
        for message in result.all_messages()
        for part in message.parts
        if part.part_kind == "tool-return"
    ]
    assert returns == ["It is sunny in Paris."]
    assert isinstance(result.output, str)
    assert result.output
