"""The OpenAI-compatible API with the real default model, SmolLM2-135M-Instruct, its own tool-call format
(``smollm2``), the openai client and both agent frameworks (slow: run with `make test-slow`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from testkit.service import LoopThread, free_port

from grpc_api.client import AdminClient

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from reprise.config import load_config
    from reprise.service import Service

    home = tmp_path_factory.mktemp("smol-openai") / "home"
    config = load_config({"home": str(home), "server.grpc_port": "0", "server.http_port": str(free_port()),
                          "model.num_slots": "4", "model.max_len": "2048"}, env={})
    loop = LoopThread()

    async def make():
        return Service(config)

    service = loop.call(make())
    loop.call(service.start(), timeout=300)
    admin_key = (Path(home) / "admin.key").read_text().strip()
    with AdminClient(f"127.0.0.1:{service.grpc_port}", admin_key) as admin:
        tenant, key = admin.create_tenant("smol")
    client = openai.OpenAI(api_key=key, base_url=f"http://127.0.0.1:{service.http_port}/v1", max_retries=0)
    service.test_tenant = (tenant.tenant_id, admin_key)
    yield service, client, key
    client.close()
    loop.call(service.stop(0))
    loop.close()


def test_smollm2_uses_its_own_tool_format_and_round_trips(smol) -> None:
    service, client, _ = smol
    model = client.models.list().data[0].id
    assert service.core.info.tool_call_format == "smollm2"
    assert model == "SmolLM2-135M-Instruct"  # the name the README's example asks for, not the cache folder's
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60)
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()  # a real model fills it in
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "sunny"}'}]
    final = client.chat.completions.create(model=model, messages=messages, max_tokens=40)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    spec = [client.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                           extra_body={"speculation": mode}) for mode in ("auto", "off")]
    assert spec[0].choices[0].message.content == spec[1].choices[0].message.content == final.choices[0].message.content


def test_frameworks_with_smollm2(smol) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    _, client, key = smol
    base_url, model = str(client.base_url), client.models.list().data[0].id
    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        seen.append(city)
        return json.dumps({"city": city, "temperature_c": 18, "sky": "sunny"})

    async def run_agent() -> str:
        async with openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0) as c:
            agent = Agent(name="weather", tools=[get_weather], instructions="Answer using the tool.",
                          model=OpenAIChatCompletionsModel(model=model, openai_client=c),
                          model_settings=ModelSettings(tool_choice="required", max_tokens=60))
            result = await Runner.run(agent, "What is the weather in Lisbon?", max_turns=4)
            return str(result.final_output)

    answer = asyncio.run(run_agent())
    assert seen and "lisbon" in seen[0].lower() and answer

    @tool
    def weather(city: str) -> str:
        """Get the current weather of a city."""
        return json.dumps({"city": city, "sky": "rainy"})

    llm = ChatOpenAI(model=model, base_url=base_url, api_key=key, temperature=0, max_tokens=60, max_retries=0)
    messages = [HumanMessage("What is the weather in Oslo?")]
    ai = llm.bind_tools([weather], tool_choice="required").invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "weather" and "oslo" in ai.tool_calls[0]["args"]["city"].lower()
    final = llm.bind_tools([weather]).invoke(messages + [ai, weather.invoke(ai.tool_calls[0])])
    assert isinstance(final.content, str) and final.content


def test_tool_call_shapes_draft_across_calls(smol) -> None:
    """The same forced tool call twice in one session: the second drafts the call from the first turn's
    recorded tokens (and the grammar's forced text), so it takes fewer model steps."""
    service, client, _ = smol
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Check the weather in Rome, Italy please."}]
    tenant_id, admin_key = service.test_tenant

    def accepted() -> int:
        with AdminClient(f"127.0.0.1:{service.grpc_port}", admin_key) as admin:
            return admin.index_stats(tenant_id)[0].num_accepted_tokens

    outs, gains = [], []
    for _ in range(2):
        before = accepted()
        outs.append(client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                                   tool_choice="required", max_tokens=60, prompt_cache_key="rome"))
        gains.append(accepted() - before)
    assert outs[0].choices[0].message.tool_calls[0].function.arguments == \
        outs[1].choices[0].message.tool_calls[0].function.arguments
    assert gains[1] > gains[0] and gains[1] >= outs[1].usage.completion_tokens // 2
