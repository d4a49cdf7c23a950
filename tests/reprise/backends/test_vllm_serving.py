"""The whole service on the vLLM engine (``model.engine = "vllm"``, the real SmolLM2-135M-Instruct) through
its OpenAI-compatible API: the same tool-calling and structured-output cases as the own engine's tests
(``tool_choice`` required / a named function / allowed_tools, ``response_format`` json_object /
json_schema; every output parsed and valid under its schema), the refusals of what vLLM cannot honour,
and the agent frameworks (tests/testkit/frameworks.py).

One service for the module: vLLM's start-up on CPU is the cost (tens of seconds with ``enforce_eager``).
Skipped, saying why, where vLLM is not installed (``make install-vllm``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from testkit import frameworks
from testkit.service import LoopThread, Running, free_port

from reprise.backends.vllm.versions import VllmUnavailableError, require_vllm

try:
    require_vllm()
    _SKIP = ""
except VllmUnavailableError as exc:
    _SKIP = str(exc)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "vLLM installed")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city for a number of days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
BOOK = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight",
    "parameters": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]}}}
TOOLS = [WEATHER, TIME, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo for the next two days?"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Running]:
    from grpc_api.client import AdminClient
    from reprise.backends.vllm.engine import VllmEngine, VllmSettings
    from reprise.config import load_config
    from reprise.service import Service
    from verifier.models import ensure_default_model

    home: Path = tmp_path_factory.mktemp("vllm-serving") / "home"
    config = load_config({"home": str(home), "model.engine": "vllm", "model.max_len": "2048",
                          "model.num_slots": "8", "server.grpc_port": "0", "server.http_port": str(free_port())},
                         env={})
    engine = VllmEngine(VllmSettings(model=str(ensure_default_model()), dtype="float32", max_model_len=2048,
                                     max_num_seqs=8, num_speculative_tokens=16, enforce_eager=True,
                                     kv_cache_gib=1.0))
    loop = LoopThread()

    async def make() -> Service:
        return Service(config, vllm_engine=engine)

    try:
        svc = loop.call(make())
        loop.call(svc.start(), timeout=300)
    except BaseException:
        engine.close()
        loop.close()
        raise
    running = Running(svc, loop, f"127.0.0.1:{svc.grpc_port}", f"http://127.0.0.1:{svc.http_port}",
                      (home / "admin.key").read_text().strip(), home)
    with AdminClient(running.target, running.admin_key) as admin:
        _, running.key = admin.create_tenant("frameworks")  # type: ignore[attr-defined]
    running.model = openai.OpenAI(api_key=running.key, base_url=running.http + "/v1").models.list().data[0].id  # type: ignore[attr-defined]
    yield running
    running.stop()


def client(service: Running) -> openai.OpenAI:
    return openai.OpenAI(api_key=service.key, base_url=service.http + "/v1", max_retries=0)  # type: ignore[attr-defined]


def chat(service: Running, **kwargs: object) -> object:
    body = {"model": service.model, "messages": ASK, "max_tokens": 120, "temperature": 0, **kwargs}  # type: ignore[attr-defined]
    return client(service).chat.completions.create(**body)  # type: ignore[call-overload]


def assert_one_valid_call(reply: object, names: set[str]) -> None:
    choice = reply.choices[0]  # type: ignore[attr-defined]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in names and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time", "book_flight"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "book_flight"}}]}},
     {"get_weather", "book_flight"}),
], ids=["required", "named", "allowed_tools"])
def test_forced_tool_calls_parse_and_fit_their_schema(service, tool_choice, names) -> None:
    assert_one_valid_call(chat(service, tools=TOOLS, tool_choice=tool_choice), names)


def test_a_streamed_forced_call_equals_the_unary_one(service) -> None:
    unary = chat(service, tools=TOOLS, tool_choice="required")
    stream = chat(service, tools=TOOLS, tool_choice="required", stream=True)
    calls, finish = [], None
    for chunk in stream:  # type: ignore[attr-defined]
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    got = unary.choices[0].message.tool_calls[0]  # type: ignore[attr-defined]
    assert (calls[0].function.name, calls[0].function.arguments) == (got.function.name, got.function.arguments)


def test_response_formats_are_enforced(service) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                               "temperatures": {"type": "array", "items": {"type": "integer"},
                                                                "minItems": 2, "maxItems": 3}},
              "required": ["city", "temperatures"], "additionalProperties": False}
    reply = chat(service, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)  # type: ignore[attr-defined]
    reply = chat(service, response_format={"type": "json_object"}, max_tokens=200)
    assert reply.choices[0].finish_reason == "stop"  # type: ignore[attr-defined]
    assert isinstance(json.loads(reply.choices[0].message.content), dict)  # type: ignore[attr-defined]


def test_min_tokens_yields_to_a_complete_grammar(service) -> None:
    """The grammar's end wins over min_tokens, as on the own engine: ``true``/``false`` and then the end."""
    reply = chat(service, extra_body={"min_tokens": 20}, response_format={"type": "json_schema", "json_schema": {
        "name": "b", "schema": {"type": "boolean"}}})
    assert reply.choices[0].finish_reason == "stop"  # type: ignore[attr-defined]
    assert json.loads(reply.choices[0].message.content) in (True, False)  # type: ignore[attr-defined]


def test_the_agents_sdk_on_both_paths(service) -> None:
    for api in ("chat", "responses"):
        frameworks.check_agents_sdk(service.http + "/v1", service.key, service.model, api=api)  # type: ignore[attr-defined]


def test_pydantic_ai(service) -> None:
    frameworks.check_pydantic_ai(service.http + "/v1", service.key, service.model)  # type: ignore[attr-defined]


def test_litellm(service) -> None:
    frameworks.check_litellm(service.http + "/v1", service.key, service.model)  # type: ignore[attr-defined]


def test_langchain(service) -> None:
    frameworks.check_langchain(service.http + "/v1", service.key, service.model)  # type: ignore[attr-defined]


def test_vllm_applies_penalties_and_refuses_what_it_cannot(service) -> None:
    """Presence/frequency penalties, which the own engine refuses, are applied by vLLM; logit_bias, which
    vLLM refuses with speculative decoding, and log probabilities, which neither engine returns here,
    are 400s naming the parameter."""
    plain = chat(service, max_tokens=40)
    penalized = chat(service, max_tokens=40, presence_penalty=2.0, frequency_penalty=2.0)
    assert penalized.choices[0].finish_reason in ("stop", "length")  # type: ignore[attr-defined]
    text = penalized.choices[0].message.content  # type: ignore[attr-defined]
    assert text and text != plain.choices[0].message.content  # type: ignore[attr-defined]  # greedy both: the penalty made it
    for sent, param, needle in (({"logit_bias": {"5": -100}}, "logit_bias", "with speculative decoding"),
                                ({"logprobs": True}, "logprobs", "no log probabilities")):
        with pytest.raises(openai.BadRequestError, match=needle) as exc:
            chat(service, max_tokens=8, **sent)
        assert exc.value.body["param"] == param


def test_openai_client_parse_helpers(service) -> None:
    frameworks.check_openai_parse(service.http + "/v1", service.key, service.model)  # type: ignore[attr-defined]


def test_smolagents(service) -> None:
    frameworks.check_smolagents(service.http + "/v1", service.key, service.model)  # type: ignore[attr-defined]


def test_tools_the_model_may_call_beside_a_response_format(service) -> None:
    """tool_choice auto with tools and a json_schema: one valid call or JSON valid under the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    seen = set()
    for ask in ("Use the get_weather tool for Oslo.", "Answer in JSON: is it sunny in Lima?"):
        reply = chat(service, messages=[{"role": "user", "content": ask}], tools=TOOLS,
                     response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
        choice = reply.choices[0]  # type: ignore[attr-defined]
        seen.add(choice.finish_reason)
        if choice.finish_reason == "tool_calls":
            assert_one_valid_call(reply, set(SCHEMAS))
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
    print("finish reasons seen:", sorted(seen))
