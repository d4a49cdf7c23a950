"""Agent frameworks, unchanged, against a running service's OpenAI-compatible API: one check per framework,
shared by the own engine's tests (tests/reprise/server/test_agent_frameworks.py) and vLLM's
(tests/reprise/backends/test_vllm_serving.py).

Each check runs a tool loop in which the tool is really executed and ends with a structured output parsed
into a typed object. The calls are forced (``tool_choice`` required, a named function or allowed tools)
and the final output is shaped by ``response_format``: so the structure is the grammar's whatever the
model (a random tiny one writes a call only when forced), while the values in it are the model's.
Every check takes the API's base URL (``http://host:port/v1``), a tenant's key and the served model's name.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Literal

import openai
from pydantic import BaseModel

City = Literal["Paris", "Oslo", "Lima"]


class Forecast(BaseModel):
    """The structured output every check asks for."""

    city: City
    sunny: bool


def _forecast_of(city: str, calls: list[Any]) -> str:
    calls.append(city)
    return json.dumps({"city": city, "forecast": "sunny"})


def check_agents_sdk(base_url: str, key: str, model: str, *, api: Literal["chat", "responses"]) -> None:
    """The OpenAI Agents SDK on chat completions (``OpenAIChatCompletionsModel``) or on its default path
    (``OpenAIResponsesModel``, /v1/responses): a forced call of a function tool, its output handed back,
    then an agent with ``output_type`` (the SDK's json_schema) whose final output parses."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        return _forecast_of(city, calls)

    async def run() -> tuple[object, list[str], list[str], object]:
        client = openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0)
        llm: Any = (OpenAIChatCompletionsModel(model=model, openai_client=client) if api == "chat"
                    else OpenAIResponsesModel(model=model, openai_client=client))
        # The run ends with the tool's output (stop_on_first_tool): a text answer of a random model runs
        # to max_tokens, which the Responses API reports as incomplete and the SDK raises on.
        agent = Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather], model=llm,
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", max_tokens=100, temperature=0))
        result = await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
        streamed = Runner.run_streamed(agent, "And in Lima?", max_turns=4)
        kinds = [e.item.type async for e in streamed.stream_events() if e.type == "run_item_stream_event"]
        typed = Agent(name="judge", instructions="Give the forecast as JSON.", model=llm, output_type=Forecast,
                      model_settings=ModelSettings(max_tokens=60, temperature=0))
        forecast = (await Runner.run(typed, "Weather in Paris?", max_turns=2)).final_output
        await client.close()
        return result.final_output, [i.type for i in result.new_items], kinds, forecast

    final, items, kinds, forecast = asyncio.run(run())
    assert len(calls) == 2 and set(calls) <= {"Paris", "Oslo", "Lima"}
    assert items == ["tool_call_item", "tool_call_output_item"]
    assert json.loads(str(final))["forecast"] == "sunny"  # the executed tool's output ended the run
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert isinstance(forecast, Forecast)


def check_pydantic_ai(base_url: str, key: str, model: str) -> None:
    """pydantic-ai's ``OpenAIChatModel``: the first step may call only two of three tools (a list of
    tools, which pydantic-ai sends as an ``allowed_tools`` tool_choice), the tool runs, and the run ends
    with ``NativeOutput`` (response_format json_schema) parsed into ``Forecast``."""
    import httpx
    from pydantic_ai import Agent, NativeOutput, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    sent: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [record]})
    client = openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0, http_client=http)
    llm = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
    calls: list[str] = []

    def settings(ctx: RunContext[None]) -> ModelSettings:
        # Two of the three tools on the first step, then the final answer without tools ("auto" would let
        # a random model call again; a static list would need an output tool).
        return {"tool_choice": ["get_weather", "get_time"] if ctx.run_step <= 1 else "none", "max_tokens": 100,
                "temperature": 0}

    agent = Agent(llm, output_type=NativeOutput(Forecast), model_settings=settings)

    @agent.tool_plain
    def get_weather(city: City) -> str:
        """The weather in a city."""
        return _forecast_of(city, calls)

    @agent.tool_plain
    def get_time(city: City) -> str:
        """The local time in a city."""
        calls.append(city)
        return "12:00"

    booked: list[str] = []

    @agent.tool_plain
    def book_flight(city: City) -> str:
        """Book a flight (not allowed on the first step)."""
        booked.append(city)
        return "booked"

    result = agent.run_sync("What is the weather in Oslo?")
    assert isinstance(result.output, Forecast)
    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo", "Lima") and not booked
    first = sent[0]
    assert first["tool_choice"]["type"] == "allowed_tools", first["tool_choice"]
    assert {t["function"]["name"] for t in first["tool_choice"]["allowed_tools"]["tools"]} == {"get_weather",
                                                                                                "get_time"}
    assert first["response_format"]["type"] == "json_schema"  # sent with the forced step too: the call wins
    kinds = [part.part_kind for message in result.all_messages() for part in message.parts]
    assert kinds == ["user-prompt", "tool-call", "tool-return", "text"]


def check_litellm(base_url: str, key: str, model: str) -> None:
    """litellm's ``completion`` (the ``openai/`` provider at ``api_base``): a forced tool call, streamed
    and rebuilt with ``litellm.stream_chunk_builder``, executed, its result sent back, and a json_schema
    answer parsed into ``Forecast``."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list
    import litellm

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                       "required": ["city"], "additionalProperties": False}}}]
    common = {"model": f"openai/{model}", "api_base": base_url, "api_key": key, "temperature": 0, "max_tokens": 100,
              "num_retries": 0}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    unary = litellm.completion(messages=messages, tools=tools, tool_choice="required", **common)
    assert unary.choices[0].finish_reason == "tool_calls"
    chunks = list(litellm.completion(messages=messages, tools=tools, tool_choice="required", stream=True, **common))
    assert len(chunks) > 1
    built = litellm.stream_chunk_builder(chunks, messages=messages)
    assert built is not None and built.choices[0].finish_reason == "tool_calls"
    call = built.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert call.function.arguments == unary.choices[0].message.tool_calls[0].function.arguments  # greedy: the same
    calls: list[str] = []
    output = _forecast_of(json.loads(call.function.arguments)["city"], calls)
    messages += [built.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": output}]
    # tool_choice "none": with "auto" a call would be allowed beside the format, and a random model may take it.
    answer = litellm.completion(messages=messages, tools=tools, tool_choice="none", response_format=Forecast, **common)
    forecast = Forecast.model_validate_json(answer.choices[0].message.content)
    assert calls and forecast.city in ("Paris", "Oslo", "Lima")


def check_langchain(base_url: str, key: str, model: str) -> None:
    """LangChain's ``ChatOpenAI(...).bind_tools`` in a two-step loop (each step forced to a named tool and
    fed the previous tool's result), a streamed forced call merged from its chunks, and
    ``with_structured_output(Forecast, method="json_schema")``."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: Literal[1, 2, 3], b: Literal[1, 2, 3]) -> int:
        """Add two small numbers."""
        return a + b

    @tool
    def double(x: Literal[2, 3, 4, 5, 6]) -> int:
        """Double a number."""
        return 2 * x

    llm = ChatOpenAI(model=model, base_url=base_url, api_key=key, temperature=0, max_tokens=100, max_retries=0)
    tools = {"add": add, "double": double}
    messages: list[Any] = [SystemMessage("Use the tools."), HumanMessage("Add two numbers, then double the sum.")]
    results = []
    for name in ("add", "double"):
        ai = llm.bind_tools([add, double], tool_choice=name).invoke(messages)
        assert ai.response_metadata["finish_reason"] == "tool_calls" and len(ai.tool_calls) == 1
        call = ai.tool_calls[0]
        assert call["name"] == name and call["id"].startswith("call_")
        messages += [ai, tools[name].invoke(call)]
        results.append(messages[-1].content)
    assert int(results[0]) in range(2, 7) and int(results[1]) % 2 == 0
    chunks = list(llm.bind_tools([add, double], tool_choice="required").stream(messages[:2]))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert len(merged.tool_calls) == 1 and merged.tool_calls[0]["name"] in tools
    forecast = llm.with_structured_output(Forecast, method="json_schema").invoke("Weather in Lima, as JSON.")
    assert isinstance(forecast, Forecast)


def check_openai_parse(base_url: str, key: str, model: str) -> None:
    """The ``openai`` client's own helpers: ``chat.completions.parse`` (a pydantic ``response_format`` and a
    strict ``pydantic_function_tool`` whose call arrives parsed) and ``responses.parse`` (``text_format``)."""
    client = openai.OpenAI(api_key=key, base_url=base_url, max_retries=0)

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: City

    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    called = client.chat.completions.parse(model=model, messages=ask, tools=[openai.pydantic_function_tool(GetWeather)],
                                           tool_choice="required", max_completion_tokens=100, temperature=0)
    call = called.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)  # type: ignore[union-attr]
    calls: list[str] = []
    output = _forecast_of(call.function.parsed_arguments.city, calls)  # type: ignore[union-attr]
    answer = client.chat.completions.parse(
        model=model, response_format=Forecast, max_completion_tokens=100, temperature=0,
        messages=[*ask, called.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
                  {"role": "tool", "tool_call_id": call.id, "content": output}])
    assert isinstance(answer.choices[0].message.parsed, Forecast)
    parsed = client.responses.parse(model=model, input="Weather in Lima?", text_format=Forecast, max_output_tokens=100,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Forecast) and calls
    client.close()


def check_smolagents(base_url: str, key: str, model: str) -> None:
    """smolagents' ``OpenAIModel`` and ``ToolCallingAgent``: its step forces a call (smolagents' default
    ``tool_choice`` "required", beside its stop strings) of the agent's tool or its ``final_answer`` tool,
    which smolagents runs; then a ``response_format`` json_schema answer, parsed into ``Forecast``."""
    from smolagents import OpenAIModel, ToolCallingAgent, tool

    calls: list[str] = []

    @tool
    def get_weather(city: City) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        return _forecast_of(city, calls)

    llm = OpenAIModel(model_id=model, api_base=base_url, api_key=key, max_tokens=400, temperature=0)
    # One step: a random model's final_answer (a free string) may run to max_tokens; the answer after
    # the last step is a plain text request.
    agent = ToolCallingAgent(tools=[get_weather], model=llm, max_steps=1, verbosity_level=0)
    agent.run("What is the weather in Oslo?")
    executed = [call.name for step in agent.memory.steps for call in (getattr(step, "tool_calls", None) or [])]
    assert executed and set(executed) <= {"get_weather", "final_answer"}, executed
    assert ("get_weather" in executed) == bool(calls)  # the calls smolagents ran are the ones it reports
    schema = {"name": "forecast", "schema": Forecast.model_json_schema(), "strict": True}
    reply = llm.generate([{"role": "user", "content": [{"type": "text", "text": "Weather in Paris as JSON?"}]}],
                         response_format={"type": "json_schema", "json_schema": schema})
    assert isinstance(Forecast.model_validate_json(str(reply.content)), Forecast)
