"""Agent frameworks, unchanged, drive a multi-step tool loop against the service's OpenAI-compatible API:
the OpenAI Agents SDK (its chat-completions model class and a function tool) and LangChain
(``ChatOpenAI(...).bind_tools(...)``). With a random tiny model a call only comes out when the grammar
forces it, so each loop forces the calls it needs (``tool_choice``) and then lets the model answer."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from testkit.service import start_service

from grpc_api.client import AdminClient

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    r = start_service(tmp_path_factory.mktemp("agents") / "home", **{"model.max_len": "4000"})
    with AdminClient(r.target, r.admin_key) as admin:
        _, r.key = admin.create_tenant("agents")  # type: ignore[attr-defined]
    yield r
    r.stop()


def test_openai_agents_sdk_tool_loop(service) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: Literal[1, 2, 3]) -> str:
        """The weather forecast of a city for a number of days."""
        calls.append((city, days))
        return json.dumps({"city": city, "forecast": ["sunny"] * days})

    async def run() -> tuple[str, list, list]:
        client = openai.AsyncOpenAI(api_key=service.key, base_url=service.http + "/v1", max_retries=0)
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        # tool_choice "required" on the first turn; the SDK resets it to auto once a tool ran
        # (reset_tool_choice), so the second turn answers in text and ends the run.
        agent = Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0))
        result = await Runner.run(agent, "What is the weather in Oslo for two days?", max_turns=4)
        streamed = Runner.run_streamed(agent, "And in Lima?", max_turns=4)
        kinds = [event.item.type async for event in streamed.stream_events() if event.type == "run_item_stream_event"]
        await client.close()
        return result.final_output, [item.type for item in result.new_items], kinds

    final, items, streamed_items = asyncio.run(run())
    assert len(calls) == 2 and all(c in ("Paris", "Oslo", "Lima") and d in (1, 2, 3) for c, d in calls)
    assert items[:2] == ["tool_call_item", "tool_call_output_item"] and items[-1] == "message_output_item"
    assert isinstance(final, str) and final  # the model's answer after seeing the tool's output
    assert streamed_items[:2] == ["tool_call_item", "tool_call_output_item"]


def test_langchain_bind_tools_loop(service) -> None:
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

    llm = ChatOpenAI(model=MODEL, base_url=service.http + "/v1", api_key=service.key, temperature=0, max_tokens=120,
                     max_retries=0)
    tools = {"add": add, "double": double}
    messages = [SystemMessage("Use the tools."), HumanMessage("Add two numbers, then double the sum.")]
    results = []
    for name in ("add", "double"):  # two forced steps, each fed the previous tool's result
        ai = llm.bind_tools([add, double], tool_choice=name).invoke(messages)
        assert ai.response_metadata["finish_reason"] == "tool_calls" and len(ai.tool_calls) == 1
        call = ai.tool_calls[0]
        assert call["name"] == name and call["id"].startswith("call_")
        messages += [ai, tools[name].invoke(call)]
        results.append(messages[-1].content)
    assert int(results[0]) in range(2, 7) and int(results[1]) % 2 == 0
    final = llm.bind_tools([add, double], tool_choice="none").invoke(messages)
    assert final.tool_calls == [] and isinstance(final.content, str) and final.content
    chunks = list(llm.bind_tools([add, double], tool_choice="required").stream(messages[:2]))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert len(merged.tool_calls) == 1 and merged.tool_calls[0]["name"] in tools


def test_example_agents_sdk_loop_runs(service, capsys) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "openai_agents_loop.py"
    spec = importlib.util.spec_from_file_location("openai_agents_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(["--base-url", service.http + "/v1", "--api-key", service.key, "--admin-key",
                        service.admin_key, "--grpc-server", service.target, "--tasks", "2", "--max-tokens", "120",
                        "--api", "chat"])  # a random model answers until max_tokens: "incomplete" on Responses
    out = capsys.readouterr().out
    assert code == 0 and "model tiny-llama" in out and "task 2:" in out and '"city"' in out and "hit rate" in out
