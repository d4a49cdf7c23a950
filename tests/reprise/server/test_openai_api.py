"""The OpenAI-compatible API with the official ``openai`` client against the real service (encrypted store,
engine, a tiny random Llama with a byte-level tokenizer): text, tool calls, structured output, errors."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel
from testkit.service import start_service

from grpc_api.client import AdminClient, RepriseClient

MODEL = "tiny-llama"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    r = start_service(tmp_path_factory.mktemp("openai") / "home", **{
        "model.max_len": "3000", "server.max_requests_per_tenant": "1", "server.stream_chunk_tokens": "4"})
    with AdminClient(r.target, r.admin_key) as admin:
        _, key = admin.create_tenant("acme")
    r.key = key  # type: ignore[attr-defined]
    yield r
    r.stop()


@pytest.fixture
def client(service):
    with openai.OpenAI(api_key=service.key, base_url=service.http + "/v1", max_retries=0) as c:
        yield c


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def test_text_sync_and_stream_equal_grpc(service, client) -> None:
    with RepriseClient(service.target, service.key) as grpc_client:
        expected = grpc_client.generate(messages=ask("Hi"), max_new_tokens=24, do_not_record=True)
    done = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=24, temperature=0)
    assert done.choices[0].message.content == expected.text and done.choices[0].message.role == "assistant"
    assert done.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert done.usage.prompt_tokens == expected.prompt_tokens and done.usage.completion_tokens == expected.completion_tokens
    assert done.usage.prompt_tokens_details.cached_tokens == 0 and done.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_completion_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].usage.completion_tokens == expected.completion_tokens and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_async_client_streamed_and_not(service) -> None:
    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(api_key=service.key, base_url=service.http + "/v1", max_retries=0) as c:
            done = await c.chat.completions.create(model=MODEL, messages=ask("Hello"), max_tokens=20)
            stream = await c.chat.completions.create(model=MODEL, messages=ask("Hello"), max_tokens=20, stream=True)
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            return done.choices[0].message.content or "", text

    whole, streamed = asyncio.run(run())
    assert whole and whole == streamed


def check_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima") and args["days"] in (1, 2, 3)
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(client, choice) -> None:
    messages = ask("What is the weather in Paris for 2 days?")
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=200)
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    args = check_call(call)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", **args})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=16)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_streamed_tool_call(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ask("Weather in Oslo?"), tools=[WEATHER],
                                            tool_choice="required", max_tokens=200, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += d.id or ""
            slot["name"] += d.function.name or ""
            slot["arguments"] += d.function.arguments or ""
        assert not chunk.choices[0].delta.content  # a forced call holds no text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Oslo", "Lima")


class Verdict(BaseModel):
    ok: bool
    grade: Literal["a", "b", "c"]
    score: Literal[1, 2, 3]


def test_json_schema_parsed_by_pydantic(client) -> None:
    done = client.chat.completions.parse(model=MODEL, messages=ask("Grade this."), response_format=Verdict,
                                         max_tokens=100)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.grade in ("a", "b", "c")
    obj = client.chat.completions.create(model=MODEL, messages=ask("json please"), max_tokens=150,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_errors_are_openai_errors(service, client) -> None:
    with (openai.OpenAI(api_key="rpk_wrong", base_url=service.http + "/v1", max_retries=0) as wrong,
          pytest.raises(openai.AuthenticationError)):
        wrong.chat.completions.create(model=MODEL, messages=ask("x"))
    with (openai.OpenAI(api_key=service.admin_key, base_url=service.http + "/v1", max_retries=0) as admin,
          pytest.raises(openai.PermissionDeniedError, match="admin key")):
        admin.chat.completions.create(model=MODEL, messages=ask("x"))
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=ask("x"))
    for bad, needle in (({"n": 2}, "n must be 1"), ({"temperature": -1}, "temperature must be"),
                        ({"max_tokens": 0}, "max_tokens must be in"), ({"top_p": 2}, "top_p must be"),
                        ({"tool_choice": "required"}, "no tools"), ({"stop": 3}, "stop must be"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role")):
        with pytest.raises(openai.BadRequestError, match=needle.replace("[", r"\[")) as exc:
            client.chat.completions.create(**{"model": MODEL, "messages": ask("x"), **bad})
        assert exc.value.status_code == 400 and exc.value.body["type"] == "invalid_request_error"
    done = client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2,
                                          extra_body={"some_future_parameter": {"x": 1}}, user="u-1")
    assert done.choices[0].message.content is not None  # unknown parameters are ignored
    big = httpx.post(service.http + "/v1/chat/completions", headers={"Authorization": f"Bearer {service.key}"},
                     content=b"{" + b" " * (17 << 20) + b"}", timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_429_under_the_tenant_limit_with_retry_after(service, client) -> None:
    long = client.chat.completions.create(model=MODEL, messages=ask("go"), max_tokens=2500, stream=True,
                                          extra_body={"ignore_eos": True})
    next(iter(long))  # admitted and decoding
    try:
        with pytest.raises(openai.RateLimitError) as exc:
            client.chat.completions.create(model=MODEL, messages=ask("again"), max_tokens=4)
        assert exc.value.response.headers["retry-after"] == "1"
        assert "requests in flight" in exc.value.message
    finally:
        long.close()
    for _ in range(100):  # the aborted stream frees its place at the engine's next step
        try:
            client.chat.completions.create(model=MODEL, messages=ask("again"), max_tokens=2)
            break
        except openai.RateLimitError:
            threading.Event().wait(0.05)
    else:
        pytest.fail("the tenant's place was never freed")


def test_a_client_gone_frees_its_place(service, client) -> None:
    with pytest.raises(httpx.TimeoutException):  # the client gives up on a long unary request
        httpx.post(service.http + "/v1/chat/completions", headers={"Authorization": f"Bearer {service.key}"},
                   json={"model": MODEL, "messages": ask("go"), "max_tokens": 2900, "ignore_eos": True}, timeout=1.0)
    for _ in range(100):  # its decoding stops and its place is free long before 2,900 tokens
        try:
            done = client.chat.completions.create(model=MODEL, messages=ask("next"), max_tokens=2)
            break
        except openai.RateLimitError:
            threading.Event().wait(0.05)
    else:
        pytest.fail("the gone client's request kept its place")
    assert done.choices[0].message.content is not None


def test_503_while_draining(service, client) -> None:
    admission = service.service.grpc.admission
    service.loop.on_loop(lambda: setattr(admission, "draining", True))
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2)
        assert exc.value.status_code == 503
        assert httpx.get(service.http + "/healthz").status_code == 503
    finally:
        service.loop.on_loop(lambda: setattr(admission, "draining", False))


def test_completions_and_models(service, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    done = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12)
    with RepriseClient(service.target, service.key) as grpc_client:
        expected = grpc_client.generate(text="Once upon", max_new_tokens=12, do_not_record=True)
    assert done.choices[0].text == expected.text and done.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=[list(b"Once upon")], max_tokens=12, stream=True) if c.choices)
    ids = client.completions.create(model=MODEL, prompt=list(b"Once upon"), max_tokens=12)
    assert streamed == ids.choices[0].text
    metrics = service.metrics()
    assert 'reprise_http_requests_total{route="/v1/completions",status="200"} 3.0' in metrics
    assert 'reprise_http_requests_total{route="/v1/models/{model_id:path}",status="404"} 1.0' in metrics


def test_speculation_keeps_the_output_and_tool_calls_draft_across_calls(service, client) -> None:
    """The same agent step twice (same session): the second drafts from the first's recorded turn, and
    the output equals decoding without speculation, for text and for a forced tool call."""
    with AdminClient(service.target, service.admin_key) as admin:
        tenant, key = admin.create_tenant("spec")
    with openai.OpenAI(api_key=key, base_url=service.http + "/v1", max_retries=0) as c:
        for kwargs in ({}, {"tools": [WEATHER], "tool_choice": "required"}):
            messages = ask("Plan the trip to Lima, then check the weather there for three days.")
            outs = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, **kwargs,
                                              extra_headers={"X-Session-Id": "task-1"}) for _ in range(2)]
            off = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, **kwargs,
                                            extra_body={"speculation": "off"}, prompt_cache_key="task-2")
            dump = [o.choices[0].message.model_dump(exclude={"tool_calls": {"__all__": {"id"}}}) for o in
                    (*outs, off)]
            assert dump[0] == dump[1] == dump[2]
        with AdminClient(service.target, service.admin_key) as admin:
            [stats] = admin.index_stats(tenant.tenant_id)
        assert stats.num_accepted_tokens > 40  # the repeats drafted from history, the forced call too


def test_context_overflow_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL, messages=ask("x" * 3500), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        list(client.chat.completions.create(model=MODEL, messages=ask("x" * 3500), max_tokens=4, stream=True))



def test_what_an_engine_cannot_honour_is_refused_never_ignored(client) -> None:
    """The own engine applies no presence/frequency penalty or logit bias (vLLM does); no engine here
    returns log probabilities or stores chat completions: each is a 400 naming the parameter."""
    for sent, param, needle in (
            ({"presence_penalty": 0.5}, "presence_penalty", "not supported by this server's engine"),
            ({"frequency_penalty": -1}, "frequency_penalty", "model.engine vllm"),
            ({"logit_bias": {"5": -100}}, "logit_bias", "not supported by this server's engine"),
            ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
            ({"presence_penalty": 3}, "presence_penalty", "must be in [-2, 2]"),
            ({"logprobs": True}, "logprobs", "no log probabilities"),
            ({"top_logprobs": 2}, "top_logprobs", "no log probabilities"),
            ({"store": True}, "store", "/v1/responses stores"),
            ({"modalities": ["text", "audio"]}, "modalities", "text only"),
            ({"functions": [{"name": "f"}]}, "functions", "send tools")):
        with pytest.raises(openai.BadRequestError, match=needle.replace("[", r"\[")) as exc:
            client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2, **sent)
        assert exc.value.body["param"] == param, exc.value.body
    # Their defaults ask for nothing and pass; parallel_tool_calls false keeps a reply to one call.
    done = client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2, logprobs=False,
                                          presence_penalty=0, frequency_penalty=0.0, logit_bias={}, store=False)
    assert done.choices[0].message.content is not None
    forced = client.chat.completions.create(model=MODEL, messages=ask("Weather?"), tools=[WEATHER],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    assert len(forced.choices[0].message.tool_calls) == 1


def test_tools_the_model_may_call_beside_a_response_format(client) -> None:
    """tool_choice auto with tools and a json_schema (an agent with tools and a typed output): the reply
    is one valid call or JSON valid under the schema, whichever the model starts."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for prompt in ("Weather?", "Is it fine?", "Answer"):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(prompt), tools=[WEATHER], max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            check_call(choice.message.tool_calls[0])
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
