"""Tools and structured output on the gRPC plane, with a chat template that renders tools itself."""

from __future__ import annotations

import json

import pytest
from testkit.service import start_service

from grpc_api.client import AdminClient, RepriseClient, RepriseError
from reprise.offline.tiny import byte_level_tokenizer
from serving.records import ChatMessage, PromptInput, Tool, ToolCall

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    r = start_service(tmp_path_factory.mktemp("tools") / "home", tokenizer=byte_level_tokenizer(tool_template=True),
                      **{"model.max_len": "2000"})
    with AdminClient(r.target, r.admin_key) as admin:
        _, r.key = admin.create_tenant("acme")  # type: ignore[attr-defined]
    yield r
    r.stop()


def test_native_template_renders_tools_and_calls(service) -> None:
    core = service.service.core
    assert core.info.tool_call_format == "hermes"
    tool = Tool("get_weather", "The weather", json.dumps(WEATHER["function"]["parameters"]))
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    ids = core.renderer.render(PromptInput(messages=(ChatMessage("user", "hi"), ChatMessage("assistant", "", (call,)),
                                                 ChatMessage("tool", "sunny", tool_call_id="call_1")),
                                       tools=(tool,)))
    text = core.renderer.tokenizer.decode(ids)
    assert "Tools:" in text and '"name": "get_weather"' in text  # the template's own tool list
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|begin|>tool\nsunny" in text


def test_forced_call_round_trip_over_grpc(service) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with RepriseClient(service.target, service.key) as client:
        first = client.generate(messages=messages, tools=[WEATHER], tool_choice="get_weather", max_new_tokens=100)
        assert first.finish_reason == "tool_calls" and len(first.tool_calls) == 1
        call = first.tool_calls[0]
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
        assert first.text.startswith("<tool_call>")  # the raw reply, as the model wrote it
        chunks = list(client.generate_stream(messages=messages, tools=[WEATHER], tool_choice="required",
                                             max_new_tokens=100))
        assert "".join(c.text for c in chunks) == first.text
        messages += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        final = client.generate(messages=messages, tools=[WEATHER], tool_choice="none", max_new_tokens=8)
        assert final.finish_reason in ("length", "eos") and final.tool_calls == [] and final.text
        assert client.append_trajectory("s1", messages=messages) > 0
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        done = client.generate(messages=[{"role": "user", "content": "json"}], max_new_tokens=40,
                               response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        assert isinstance(json.loads(done.text)["ok"], bool)
        with pytest.raises(RepriseError, match="no tools") as exc:
            client.generate(messages=[{"role": "user", "content": "x"}], tool_choice="required")
        assert exc.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(RepriseError, match="schema cannot be used"):
            client.generate(messages=[{"role": "user", "content": "x"}],
                            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
