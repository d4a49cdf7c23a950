"""Property-based fuzzing (hypothesis) of both fronts' request handling, in-process: the HTTP app
(``http_api``: body reading, the chat / completions / Responses parsers, the error mapping) and the gRPC
data plane's servicer (``grpc_api.decoding``: message parsing and conversion), each over the real
serving core (``serving.prepare`` checks, the real byte-level tokenizer's chat-template rendering, the
real grammar compiler on every schema, ``reprise.backends.grammars``); only the decoding is a stand-in
that answers one token.

The property: whatever arrives, the answer is a success or one of the documented errors, a 4xx (never
a 500) with an OpenAI error object on HTTP, a status other than INTERNAL/UNKNOWN on gRPC; an
INVALID_ARGUMENT about one field of a JSON object names that field (``param``).

The default run draws about 120 examples per test (seconds); ``REPRISE_FUZZ_EXAMPLES=3000`` digs deeper.
"""

from __future__ import annotations

import asyncio
import json
import os
import string
from collections.abc import AsyncGenerator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from grpc_api.decoding import DecodingServicer
from grpc_api.interceptors import _classify, _parser, _principal
from grpc_api.v1 import decoding_pb2
from http_api.app import build_app
from reprise.backends.grammars import Grammars
from reprise.offline.tiny import TINY_EOS, TINY_VOCAB, byte_level_tokenizer
from serving import errors
from serving.admission import CancelEvent
from serving.core import ServingCore
from serving.prepare import ServingSettings
from serving.records import Finished, Principal, Request, Tokens, Usage
from serving.render import model_info

KEY = "rpk_fuzz"
TENANT = Principal("tenant", "f" * 32)
EXAMPLES = int(os.environ.get("REPRISE_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


class OneTokenBackend:
    """The decode seam with the real tokenizer and grammar compiler, answering one token per request."""

    def __init__(self) -> None:
        self.tokenizer = byte_level_tokenizer(tool_template=True)
        self._info = model_info(self.tokenizer, "tiny", 512, (TINY_EOS,), TINY_VOCAB)
        self.grammars = Grammars(self.tokenizer, TINY_VOCAB, (TINY_EOS,))
        self.alive = True

    def model_info(self) -> Any:
        return self._info

    async def check(self, request: Request) -> None:
        if request.params.constraint is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.grammars.compile, request)

    async def generate(self, request: Request, cancel: CancelEvent) -> AsyncGenerator[Any, None]:
        yield Tokens((65,), "A")
        yield Finished("length", Usage(len(request.prompt_ids), 1, steps=1), text="A", content="A", token_ids=(65,))

    async def append_trajectory(self, tenant: str, session_id: str, token_ids: Any) -> int:
        return len(token_ids)

    async def close(self) -> None:
        pass


class Keys:
    def authenticate(self, key: str) -> Principal | None:
        return TENANT if key == KEY else None


@pytest.fixture(scope="module")
def core() -> ServingCore:
    return ServingCore(OneTokenBackend(), ServingSettings(default_max_new_tokens=16), render_threads=1)


@pytest.fixture(scope="module")
def http(core):
    app = build_app(core, Keys(), lambda: (b"", "text/plain"), lambda service="": "serving", max_body_bytes=1 << 20)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


# ---- strategies -----------------------------------------------------------------------------------

ODD_TEXT = st.sampled_from(["", "\x00", "a\x00b", "\ufeff", "\U0010ffff", "<tool_call>", "</tool_call>", "{", "\"",
                            "\\", "\u202e", "é", "\r\n", "<|end|>", "<|begin|>", "{{ x }}", "{% if %}"])
TEXT = st.one_of(st.text(max_size=40), ODD_TEXT)
NUMBER = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, 1, 2, -1, 0.5, 1e-45, 1e308, 2**63, 2**64]))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


def either(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values, sometimes any JSON value (each field rarely, so that many examples get
    past the first check and reach rendering and the grammar compiler)."""
    return st.integers(0, 15).flatmap(lambda i: JSON if i == 15 else plausible)


def mostly(usual: st.SearchStrategy, edges: st.SearchStrategy) -> st.SearchStrategy:
    return st.integers(0, 4).flatmap(lambda i: edges if i == 4 else usual)


def count(usual_max: int, low: int, high: int) -> st.SearchStrategy:
    return mostly(st.integers(1, usual_max), st.integers(low, high))


SCHEMA_TYPES = ["string", "integer", "number", "boolean", "null", "object", "array", "strange"]
SCHEMA = st.recursive(
    st.one_of(st.fixed_dictionaries({"type": st.sampled_from(SCHEMA_TYPES)}),
              st.fixed_dictionaries({"enum": st.lists(JSON, max_size=4)}),
              st.fixed_dictionaries({"const": JSON}),
              st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/a", "#/nope", "http://x/y", "#/properties/a"])}),
              st.fixed_dictionaries({"type": st.just("string")}, optional={
                  "minLength": st.integers(0, 10**9), "maxLength": st.integers(0, 10**12),
                  "pattern": st.sampled_from(["^a+$", "(a|aa)*b", "[", "\\d{3,}", "^$", ".*"]),
                  "format": st.sampled_from(["date", "email", "uuid", "nope"])}),
              st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
                  "minimum": NUMBER, "maximum": NUMBER, "exclusiveMinimum": NUMBER, "multipleOf": NUMBER}),
              st.just({}), st.just(True), st.just(False), JSON),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object")}, optional={
            "properties": st.dictionaries(st.sampled_from(["a", "b", "", "\x00", "é"]), inner, max_size=3),
            "required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),
            "additionalProperties": st.one_of(st.booleans(), inner), "$defs": st.fixed_dictionaries({"a": inner}),
            "minProperties": st.integers(0, 10**6)}),
        st.fixed_dictionaries({"type": st.just("array")}, optional={
            "items": inner, "minItems": st.integers(0, 10**6), "maxItems": st.integers(0, 10**6),
            "prefixItems": st.lists(inner, max_size=3)}),
        st.dictionaries(st.sampled_from(["anyOf", "allOf", "oneOf"]), st.lists(inner, max_size=3), min_size=1,
                        max_size=1),
        st.fixed_dictionaries({"not": inner}),
    ),
    max_leaves=8,
)

PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_text"]), "text": either(TEXT)})
CALL = st.fixed_dictionaries({"id": either(TEXT), "type": st.just("function"), "function": either(
    st.fixed_dictionaries({"name": either(TEXT), "arguments": either(TEXT)}))})
MESSAGE = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"]))},
    optional={"content": either(st.one_of(TEXT, st.lists(PART, max_size=2))),
              "tool_calls": either(st.lists(CALL, max_size=2)),
              "tool_call_id": either(TEXT), "name": either(TEXT)})
TOOL = st.fixed_dictionaries({"type": either(st.just("function")), "function": either(st.fixed_dictionaries(
    {"name": either(st.sampled_from(["f", "g", "get_weather", "", "bad name", "x" * 70]))},
    optional={"description": either(TEXT), "parameters": either(SCHEMA)}))})
TOOL_CHOICE = either(st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                               st.fixed_dictionaries({"type": st.just("function"),
                                                      "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "z"])})}),
                               st.fixed_dictionaries({"type": st.just("allowed_tools"), "allowed_tools": st.fixed_dictionaries(
                                   {"mode": either(st.sampled_from(["auto", "required"])),
                                    "tools": either(st.lists(st.fixed_dictionaries(
                                        {"type": st.just("function"),
                                         "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})}),
                                        max_size=2))})})))
RESPONSE_FORMAT = either(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": either(st.fixed_dictionaries(
        {"name": TEXT, "schema": either(SCHEMA)}, optional={"strict": st.booleans()}))})))
SAMPLING = {
    "max_tokens": either(count(200, -5, 600)), "max_completion_tokens": either(count(200, -5, 600)),
    "min_tokens": either(count(8, -5, 600)), "temperature": either(mostly(st.floats(0, 2), st.floats(-1, 3))),
    "top_p": either(mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5))), "top_k": either(count(50, -5, 300)),
    "seed": either(count(100, -5, 2**64)), "repetition_penalty": either(mostly(st.floats(0.5, 2), st.floats(-1, 20))),
    "stop": either(st.one_of(TEXT, st.lists(TEXT, max_size=20))), "n": either(mostly(st.just(1), st.integers(-1, 3))),
    "stream": either(st.booleans()), "ignore_eos": either(st.booleans()),
    "speculation": either(st.sampled_from(["auto", "off", "on"])), "prompt_cache_key": either(TEXT),
    "user": either(TEXT), "model": either(mostly(st.just("tiny"), st.just("other"))),
    "stream_options": either(st.fixed_dictionaries({"include_usage": either(st.booleans())})),
}
CHAT = st.fixed_dictionaries({"messages": either(st.lists(MESSAGE, min_size=1, max_size=4))}, optional={
    **SAMPLING, "tools": either(st.lists(TOOL, max_size=3)), "tool_choice": TOOL_CHOICE,
    "response_format": RESPONSE_FORMAT})
COMPLETION = st.fixed_dictionaries({"prompt": either(st.one_of(TEXT, st.lists(st.integers(-3, 300), max_size=8),
                                                               st.lists(TEXT, max_size=2)))},
                                   optional={**SAMPLING, "echo": either(st.booleans())})
ITEM = st.one_of(MESSAGE.map(lambda m: {"type": "message", **m}), st.fixed_dictionaries(
    {"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "web_search_call"]),
     "call_id": either(TEXT), "name": either(st.sampled_from(["f", "g"])), "arguments": either(TEXT),
     "output": either(TEXT)}))
RESPONSES = st.fixed_dictionaries({"input": either(st.one_of(TEXT, st.lists(ITEM, min_size=1, max_size=4))),
                                   "store": mostly(st.just(False), st.booleans())}, optional={
    **{k: v for k, v in SAMPLING.items() if k not in ("max_tokens", "max_completion_tokens", "n")},
    "max_output_tokens": either(st.integers(-5, 600)), "instructions": either(TEXT),
    "tools": either(st.lists(TOOL.map(lambda t: {"type": t.get("type"), **(t.get("function") or {})}
                                      if isinstance(t, dict) and isinstance(t.get("function"), dict) else t),
                             max_size=3)),
    "tool_choice": TOOL_CHOICE, "text": either(st.fixed_dictionaries({"format": RESPONSE_FORMAT})),
    "truncation": either(mostly(st.just("disabled"), st.just("auto"))),
    "top_logprobs": either(mostly(st.just(0), st.integers(0, 5))),
    "reasoning": either(st.fixed_dictionaries({"effort": st.none()})),
    "background": either(mostly(st.just(False), st.booleans()))})


# ---- HTTP -----------------------------------------------------------------------------------------

WHOLE_BODY = ("the body", "the request")  # messages about the body as a whole name no field


def check_http(response: Any, body: Any) -> None:
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, (response.status_code, response.text[:500], body)
    if response.status_code == 200:
        return
    doc = response.json()
    error = doc["error"]
    assert error["message"] and error["type"], doc
    if response.status_code == 400 and isinstance(body, dict) and not error["message"].startswith(WHOLE_BODY):
        assert error["param"], (doc, body)


def post(http, path: str, body: Any) -> Any:
    raw = json.dumps(body, allow_nan=True).encode()
    return http.post(path, content=raw, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


@FUZZ
@given(body=CHAT)
def test_chat_bodies_get_an_answer_or_a_named_4xx(http, body) -> None:
    check_http(post(http, "/v1/chat/completions", body), body)


@settings(FUZZ, max_examples=EXAMPLES // 2)
@given(body=COMPLETION)
def test_completion_bodies_get_an_answer_or_a_named_4xx(http, body) -> None:
    check_http(post(http, "/v1/completions", body), body)


@FUZZ
@given(body=RESPONSES)
def test_responses_bodies_get_an_answer_or_a_named_4xx(http, body) -> None:
    check_http(post(http, "/v1/responses", body), body)


@settings(FUZZ, max_examples=EXAMPLES * 2 // 3)
@given(raw=st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v, allow_nan=True).encode()),
                     CHAT.map(lambda b: json.dumps(b).encode()).flatmap(
                         lambda raw: st.integers(0, max(0, len(raw) - 1)).map(lambda cut: raw[:cut]))),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]))
def test_raw_bytes_get_a_4xx_error_object(http, raw, path) -> None:
    response = http.post(path, content=raw, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code < 500, (response.status_code, response.text[:300], raw[:200])
    if response.status_code != 200:
        assert response.json()["error"]["message"]


# ---- gRPC -----------------------------------------------------------------------------------------


def _message(m: dict) -> dict:
    return {"role": m["role"] if isinstance(m.get("role"), str) else "user",
            "content": m["content"] if isinstance(m.get("content"), str) else ""}


GRPC_REQUEST = st.fixed_dictionaries({
    "input": st.one_of(st.tuples(st.just("text"), TEXT), st.tuples(st.just("tokens"), st.lists(st.integers(-3, 300),
                                                                                                  max_size=8)),
                       st.tuples(st.just("messages"), st.lists(MESSAGE.map(_message), max_size=3))),
    "temperature": st.one_of(st.none(), mostly(st.floats(0, 2, width=32), st.floats(width=32))),
    "top_p": st.one_of(st.none(), mostly(st.floats(0.125, 1, width=32), st.floats(width=32))),
    "top_k": st.one_of(st.none(), count(50, -(2**31), 2**31 - 1)),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "repetition_penalty": st.one_of(st.none(), mostly(st.floats(0.5, 2, width=32), st.floats(width=32))),
    "max_new_tokens": st.one_of(st.none(), count(200, -(2**31), 2**31 - 1)),
    "min_new_tokens": mostly(st.just(0), st.integers(-(2**31), 2**31 - 1)),
    "stop": mostly(st.lists(TEXT.filter(bool), max_size=3), st.lists(TEXT, max_size=20)),
    "stop_token_ids": mostly(st.lists(st.integers(0, 257), max_size=3), st.lists(st.integers(-(2**31), 2**31 - 1),
                                                                                  max_size=4)),
    "speculation": mostly(st.integers(0, 2), st.integers(0, 5)),
    "request_id": mostly(st.text(string.ascii_letters, max_size=20), TEXT),
    "session_id": mostly(st.text(string.ascii_letters, max_size=20), TEXT),
    "stream_chunk_tokens": mostly(st.integers(0, 4), st.integers(-(2**31), 2**31 - 1)),
    "tools": st.lists(st.tuples(mostly(st.sampled_from(["f", "g"]), st.sampled_from(["", "bad name"])),
                                SCHEMA.map(json.dumps)), max_size=2, unique_by=lambda t: t[0]),
    "tool_choice": st.one_of(st.none(), mostly(st.integers(0, 3), st.integers(0, 5)), st.sampled_from(["f", "z", ""])),
    "response_format": st.tuples(mostly(st.integers(0, 4), st.integers(0, 6)), SCHEMA.map(json.dumps)),
    "corrupt": st.one_of(st.none(), st.binary(min_size=1, max_size=8)),
})


def grpc_request(spec: dict) -> bytes:
    r = decoding_pb2.GenerateRequest(request_id=spec["request_id"], session_id=spec["session_id"],
                                     speculation=spec["speculation"], stream_chunk_tokens=spec["stream_chunk_tokens"])
    kind, value = spec["input"]
    if kind == "text":
        r.text = value
    elif kind == "tokens":
        r.tokens.ids.extend(value)
    else:
        for m in value:
            r.messages.messages.add(role=m["role"], content=m["content"])
    for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty"):
        if spec[name] is not None:
            setattr(r.sampling, name, spec[name])
    if spec["max_new_tokens"] is not None:
        r.stopping.max_new_tokens = spec["max_new_tokens"]
    r.stopping.min_new_tokens = spec["min_new_tokens"]
    r.stopping.stop.extend(spec["stop"])
    r.stopping.stop_token_ids.extend(spec["stop_token_ids"])
    for name, parameters in spec["tools"]:
        r.tools.add(name=name, parameters=parameters)
    if isinstance(spec["tool_choice"], int):
        r.tool_choice.mode = spec["tool_choice"]
    elif spec["tool_choice"] is not None:
        r.tool_choice.function = spec["tool_choice"]
    r.response_format.type, r.response_format.json_schema = spec["response_format"]
    data = r.SerializeToString()
    if spec["corrupt"] is not None:  # overwrite some bytes of the wire form
        at = len(data) // 2
        data = data[:at] + spec["corrupt"] + data[at + len(spec["corrupt"]):]
    return data


class Context:
    """What the servicer asks of a gRPC context (nothing, on the unary path)."""


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@FUZZ
@given(spec=GRPC_REQUEST)
def test_grpc_generate_requests_get_an_answer_or_a_named_status(core, loop, spec) -> None:
    method = "/reprise.v1.DecodingService/Generate"
    servicer = DecodingServicer(core)
    parse = _parser(decoding_pb2.GenerateRequest.FromString, method)

    async def call() -> Any:
        _principal.set(TENANT)
        return await servicer.Generate(parse(grpc_request(spec)), Context())

    try:
        reply = loop.run_until_complete(call())
    except Exception as exc:  # noqa: BLE001 - classified as the interceptor would
        assert isinstance(exc, (errors.ServiceError, ValueError)), repr(exc)
        code, message, _ = _classify(exc, method)
        event(code.name)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and message, (code, message)
        if code == grpc.StatusCode.INVALID_ARGUMENT and isinstance(exc, errors.ServiceError):
            assert exc.param or "malformed" in message, message
    else:
        event("OK")
        assert reply.complete.usage.completion_tokens == 1


def test_the_strategies_reach_success_too(http) -> None:
    """The fuzzing is not all refusals: plausible bodies of each kind succeed."""
    ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert post(http, "/v1/chat/completions", ok).status_code == 200
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {**ok, "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                              "schema": schema}}}
    assert post(http, "/v1/chat/completions", fmt).status_code == 200
    assert post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 4}).status_code == 200
    assert post(http, "/v1/responses", {"input": "hi", "store": False}).status_code == 200
