"""The Responses API (``/v1/responses``) through the official ``openai`` client (the Agents SDK on its
default path: test_agent_frameworks.py), against a real service (tiny random Llama with a byte-level tokenizer): text and
streamed replies, function tools (forced, since a random model only calls when the grammar makes it),
``text.format`` json_schema, stored responses (GET, DELETE, input items, another tenant's id is a 404),
``previous_response_id``, and the refusals of what the server cannot do."""

from __future__ import annotations

import json

import openai
import pytest
from testkit.service import start_service

from grpc_api.client import AdminClient

MODEL = "tiny-llama"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    r = start_service(tmp_path_factory.mktemp("responses") / "home", **{"model.max_len": "4000"})
    with AdminClient(r.target, r.admin_key) as admin:
        _, r.key = admin.create_tenant("acme")  # type: ignore[attr-defined]
        _, r.other = admin.create_tenant("globex")  # type: ignore[attr-defined]
    yield r
    r.stop()


def client(service, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(api_key=key or service.key, base_url=service.http + "/v1", max_retries=0)


def test_text_reply_is_stored_and_scoped_to_the_tenant(service) -> None:
    c = client(service)
    r = c.responses.create(model=MODEL, input="Say hi", instructions="Be brief.", max_output_tokens=12,
                           temperature=0, prompt_cache_key="s1")
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.model == MODEL
    assert r.output_text and r.output[0].type == "message" and r.usage.output_tokens > 0
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert c.responses.retrieve(r.id).output_text == r.output_text
    items = c.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"]
    with pytest.raises(openai.NotFoundError):
        client(service, service.other).responses.retrieve(r.id)  # another tenant's id: a 404 like an unknown one
    with pytest.raises(openai.NotFoundError):
        client(service, service.other).responses.delete(r.id)
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    unstored = c.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_streamed_reply_equals_the_unary_one(service) -> None:
    c = client(service)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": schema}}  # the grammar ends the reply
    unary = c.responses.create(model=MODEL, input="Count", max_output_tokens=20, temperature=0, store=False, text=fmt)
    kinds, deltas = [], []
    with c.responses.stream(model=MODEL, input="Count", max_output_tokens=20, temperature=0, store=False,
                            text=fmt) as s:
        for event in s:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        completed = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(deltas) == unary.output_text == completed.output_text and json.loads(unary.output_text)["n"]
    assert len(deltas) == completed.usage.output_tokens - 1  # one event per token (the last is end-of-sequence)
    cut = [e.type for e in c.responses.create(model=MODEL, input="Count", max_output_tokens=3, store=False,
                                              stream=True)]
    assert cut[-1] == "response.incomplete"


def test_forced_function_call_then_previous_response_id(service) -> None:
    c = client(service)
    first = c.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                               max_output_tokens=200, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    second = c.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": "sunny"}], max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id and second.output_text is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the earlier turn and the call came along
    conversation = [i.type for i in c.responses.input_items.list(second.id).data]
    assert conversation == ["message", "function_call", "function_call_output"]
    # allowed_tools: only the named tools may be called, here forced
    third = c.responses.create(model=MODEL, input="Weather?", tools=[WEATHER, {**WEATHER, "name": "get_time"}],
                               tool_choice={"type": "allowed_tools", "mode": "required",
                                            "tools": [{"type": "function", "name": "get_time"}]},
                               max_output_tokens=200, store=False)
    assert [o.name for o in third.output if o.type == "function_call"] == ["get_time"]


def test_structured_output_and_refusals(service) -> None:
    c = client(service)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = c.responses.create(model=MODEL, input="json please", max_output_tokens=40, store=False,
                           text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    for kwargs, param in [({"background": True}, "background"), ({"truncation": "auto"}, "truncation"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                          ({"max_output_tokens": 0}, "max_output_tokens"),
                          ({"temperature": 5}, "temperature"),
                          ({"max_output_tokens": 3, "text": {"format": {"type": "json_schema", "name": "x",
                                                                        "schema": schema}}}, "max_output_tokens"),
                          ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
                              "x": {"$ref": "#"}}, "required": ["x"]}}], "tool_choice": "required"},
                           "tools[0].parameters")]:
        with pytest.raises(openai.BadRequestError) as exc:
            c.responses.create(model=MODEL, input="x", **kwargs)
        assert exc.value.body["param"] == param, exc.value.body
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
