"""Attacks beyond issue 22's list, from outside: huge header counts, pipelining, invalid UTF-8 and lone
surrogates, NUL and odd Unicode in every string field, tool schemas with thousands of properties or
enum entries, parameters at their extremes, gRPC messages at the size limit, streams abandoned
mid-response (the engine must stop decoding them and free their places), and one tenant using
another's request, response and session ids. Each attack gets a named refusal or a normal answer,
never a 5xx, and a normal tenant is served afterwards."""

from __future__ import annotations

import http.client
import json
import socket
import time

import grpc
import pytest
from testkit.hostile import assert_unharmed

from grpc_api.client import RepriseClient, RepriseError
from reprise.benchmarks.hostile import MiB, http_call

USER = [{"role": "user", "content": "hi"}]
ODD = "a\x00b\x01\ufeff\uffff\U0010ffff\u202e\u0301"


def chat(served, key: str, **body) -> tuple[int, dict]:
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body},
                               key=key, timeout=60)
    return status, doc


def test_huge_header_counts_and_sizes_close_the_connection(served, tenant) -> None:
    assert http_call(served.http, "GET", "/healthz", headers={f"X-H{i}": "v" * 20 for i in range(1000)})[0] == 200
    for headers in ({f"X-H{i}": "v" * 20 for i in range(20_000)}, {"X-Big": "v" * 200_000}):
        with pytest.raises(OSError):  # beyond 64 KiB of headers: the connection is dropped, nothing is held
            http_call(served.http, "GET", "/healthz", headers=headers)
    assert_unharmed(served, tenant)


def test_pipelined_requests_are_answered_in_order(served, tenant) -> None:
    with socket.create_connection(("127.0.0.1", served.http_port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 200 + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 ") < 201 or not data.endswith(b"}"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    assert data.count(b"HTTP/1.1 200") == 200 and data.rstrip().endswith(b"}") and b"HTTP/1.1 404" in data
    assert_unharmed(served, tenant)


@pytest.mark.parametrize("raw", [
    b'{"messages":[{"role":"user","content":"\xff\xfe"}],"max_tokens":4}',
    b'{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":4}',
    b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stop":["\\udfff"]}',
    b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"\\ud800":1}',
    b'{"messages":[{"role":"user","content":"x"}],"max_tokens":4,"temperature":NaN}',
    b'{"messages":[{"role":"user","content":"x"}],"max_tokens":' + b"9" * 5000 + b"}",
    b'{"messages":[{"role":"user","content":"x"}],"max_tokens":4,"temperature":1' + b"0" * 400 + b".5}",
    b"\x00" * 1000, b"", b"null", b"[]", b'"text"',
])
def test_malformed_bodies_are_400(served, attacker, raw) -> None:
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", raw=raw, key=attacker)
    assert status == 400 and doc["error"]["type"] == "invalid_request_error", (status, doc)


def test_lone_surrogates_are_refused_by_name(served, attacker) -> None:
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", key=attacker,
                               raw=b'{"messages":[{"role":"user","content":"a\\ud800"}],"max_tokens":4}')
    assert status == 400 and doc["error"]["param"] == "messages[0].content", doc
    assert "lone surrogate" in doc["error"]["message"]


@pytest.mark.parametrize("where", ["content", "stop", "user", "description", "enum", "tool_message", "schema_name",
                                   "responses_input", "instructions"])
def test_odd_unicode_and_nul_in_string_fields(served, tenant, attacker, where) -> None:
    tool = {"type": "function", "function": {"name": "f", "description": ODD, "parameters": {
        "type": "object", "properties": {ODD: {"type": "string", "enum": [ODD]}}, "required": [ODD]}}}
    if where == "responses_input" or where == "instructions":
        body = {"input": ODD, "max_output_tokens": 4} if where == "responses_input" else \
               {"input": "hi", "instructions": ODD, "max_output_tokens": 4}
        status, _, doc = http_call(served.http, "POST", "/v1/responses", body, key=attacker)
    else:
        extra = {
            "content": {"messages": [{"role": "user", "content": ODD}]},
            "stop": {"stop": [ODD]},
            "user": {"user": ODD},
            "description": {"tools": [tool]},
            "enum": {"tools": [tool], "tool_choice": "required", "max_tokens": 200},
            "tool_message": {"messages": [
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": ODD, "type": "function", "function": {"name": "f", "arguments": ODD}}]},
                {"role": "tool", "tool_call_id": ODD, "content": ODD}]},
            "schema_name": {"response_format": {"type": "json_schema", "json_schema": {"name": ODD, "schema": {
                "type": "string", "enum": [ODD]}}}, "max_tokens": 40},
        }[where]
        status, doc = chat(served, attacker, **extra)
    assert status in (200, 400), (status, doc)
    if status == 400:
        assert doc["error"]["type"] == "invalid_request_error" and doc["error"]["message"], doc
    assert_unharmed(served, tenant)


def test_odd_ids_are_refused_by_name(served, attacker) -> None:
    status, _, doc = http_call(served.http, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 4},
                               key=attacker, headers={"X-Session-Id": "a\x7fb"})
    assert status == 400 and doc["error"]["param"] == "prompt_cache_key", doc
    status, doc = chat(served, attacker, prompt_cache_key="s" * 10_000)
    assert status == 400 and doc["error"]["param"] == "prompt_cache_key", doc
    status, doc = chat(served, attacker, model=ODD)
    assert status == 404 and doc["error"]["param"] == "model", doc
    with RepriseClient(served.grpc_target, attacker) as client:
        for kwargs in ({"request_id": "r\x00"}, {"request_id": "r" * 1000}, {"session_id": "\n"}):
            with pytest.raises(RepriseError) as refused:
                client.generate(text="hi", max_new_tokens=2, **kwargs)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(("name", "schema", "tool_choice"), [
    ("3000 properties", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}, "required"),
    ("5000 enum entries", {"type": "object", "properties": {"e": {"enum": [f"v{i}" for i in range(5000)]}},
                           "required": ["e"]}, "required"),
    ("1000 required properties", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)},
                                  "required": [f"p{i}" for i in range(1000)]}, "required"),
    ("nested anyOf", {"anyOf": [{"anyOf": [{"type": "string", "pattern": f"^{i}[a-z]{{1,1000}}$"}
                                           for i in range(30)]} for _ in range(30)]}, "required"),
    ("big maxLength", {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**12}}}, "required"),
    ("huge integers", {"type": "object", "properties": {"i": {"type": "integer", "minimum": 10**300}},
                       "required": ["i"]}, "required"),
    ("catastrophic pattern", {"type": "object", "properties": {"s": {"type": "string",
                                                                    "pattern": "^(a|aa)*(b{1,1000}){1,1000}c$"}},
                              "required": ["s"]}, "required"),
])
def test_big_tool_schemas_are_bounded(served, tenant, attacker, name, schema, tool_choice) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    served.reset_peak()
    before = served.rss()
    start = time.monotonic()
    status, doc = chat(served, attacker, tools=[tool], tool_choice=tool_choice, max_tokens=300)
    took = time.monotonic() - start
    assert status in (200, 400), (status, doc)
    if status == 400:
        assert doc["error"]["param"].startswith(("tools[0]", "max_tokens", "messages")), doc
    assert took < 30 and served.peak_rss() - before < 300 * MiB, (took, (served.peak_rss() - before) / MiB)
    assert_unharmed(served, tenant)


@pytest.mark.parametrize(("field", "value"), [
    ("stop", ["x"] * 10_000), ("stop", ["x" * 100_000]), ("stop", [""]), ("stop", [1]), ("n", 0), ("n", -1),
    ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)]),
    ("messages", [{"role": "user", "content": "x"}] * 3000), ("messages", []), ("stream", "yes"),
    ("stream_options", []), ("tool_choice", {"type": "function", "function": {"name": "nope"}}),
])
def test_parameters_at_their_extremes_are_refused_by_name(served, attacker, field, value) -> None:
    status, doc = chat(served, attacker, **{field: value})
    assert status == 400 and doc["error"]["param"] is not None, (status, doc)
    assert doc["error"]["param"].split("[")[0].split(".")[0] == field, doc


def test_parameters_the_engine_cannot_honour_are_refused_by_name_whatever_their_size(served, tenant, attacker) -> None:
    for extra in ({"logprobs": True, "top_logprobs": 10**9}, {"logit_bias": {str(i): 100 for i in range(50_000)}},
                  {"frequency_penalty": 1e308}):
        status, doc = chat(served, attacker, **extra)
        assert status == 400 and doc["error"]["param"] in extra, (extra, status, doc)
    status, doc = chat(served, tenant)
    assert status == 200 and doc["choices"][0]["finish_reason"] in ("length", "stop"), doc


def test_grpc_messages_at_and_beyond_the_size_limit(served, tenant, attacker) -> None:
    served.reset_peak()
    before = served.rss()
    with RepriseClient(served.grpc_target, attacker) as client:
        with pytest.raises(RepriseError) as refused:  # just under 16 MiB: refused by its length, not rendered
            client.generate(text="x" * (16 * MiB - 200), max_new_tokens=4, timeout=60)
        assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
        with pytest.raises(RepriseError) as refused:
            client.generate(text="x" * (16 * MiB + 10), max_new_tokens=4, timeout=60)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served.peak_rss() - before < 400 * MiB
    # the same size sent raw by a client with a larger limit of its own: the server refuses it
    from reprise.benchmarks.hostile import channel

    with channel(served.grpc_target, **{"grpc.max_send_message_length": 64 * MiB}) as ch:
        call = ch.unary_unary("/reprise.v1.DecodingService/Generate")
        with pytest.raises(grpc.RpcError) as raw:
            call(b"\x12" + b"\xff\xff\xff\x0f" + b"x" * (20 * MiB), metadata=(("authorization", f"Bearer {attacker}"),))
        assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_unharmed(served, tenant)


def _open_stream(served, key: str, read: bool = True) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"messages": USER, "max_tokens": 1000, "ignore_eos": True, "stream": True}),
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    if read:
        response.read(300)  # a few events in
    return conn


def wait_idle(served, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while served.metric("reprise_num_requests_running") > 0:
        assert time.monotonic() < deadline, "abandoned requests still running"
        time.sleep(0.1)


def test_abandoned_streams_stop_decoding_and_free_their_places(served, tenant) -> None:
    key = served.create_tenant("abandoner")
    for _ in range(3):  # each round fills the engine's 4 slots, then walks away mid-response
        conns = [_open_stream(served, key) for _ in range(4)]
        for conn in conns:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        wait_idle(served)
    tokens = served.metric("reprise_generation_tokens")
    time.sleep(1.0)
    assert served.metric("reprise_generation_tokens") == tokens  # nobody decodes for the departed
    # non-streamed requests whose client leaves before the answer, and gRPC streams cancelled
    body = json.dumps({"messages": USER, "max_tokens": 1000, "ignore_eos": True}).encode()
    socks = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", served.http_port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        s.close()
    wait_idle(served)
    with RepriseClient(served.grpc_target, key) as client:
        streams = [client.generate_stream(text="hi", max_new_tokens=1000, ignore_eos=True) for _ in range(4)]
        for stream in streams:
            next(iter(stream))
        for stream in streams:
            stream.cancel()
    wait_idle(served)
    conns = [_open_stream(served, key, read=False) for _ in range(8)]  # the tenant's 8 places are free again
    for conn in conns:
        conn.close()
    wait_idle(served)
    assert_unharmed(served, tenant)


def test_another_tenants_ids_lead_nowhere(served, tenant, attacker) -> None:
    status, _, doc = http_call(served.http, "POST", "/v1/responses", {"input": "secret", "max_output_tokens": 4},
                               key=tenant)
    assert status == 200
    rid = doc["id"]
    for method, path, body in (("GET", f"/v1/responses/{rid}", None), ("GET", f"/v1/responses/{rid}/input_items", None),
                               ("DELETE", f"/v1/responses/{rid}", None),
                               ("POST", "/v1/responses", {"input": "hi", "previous_response_id": rid})):
        status, _, doc = http_call(served.http, method, path, body, key=attacker)
        assert status == 404 and "secret" not in json.dumps(doc), (method, path, doc)
    assert http_call(served.http, "GET", f"/v1/responses/{rid}", key=tenant)[0] == 200  # still there for its owner
    # a request id in flight for the tenant: the attacker can neither abort it nor learn that it exists
    with RepriseClient(served.grpc_target, tenant) as mine, RepriseClient(served.grpc_target, attacker) as theirs:
        stream = mine.generate_stream(text="hi", max_new_tokens=300, ignore_eos=True, request_id="the-id",
                                      session_id="the-session")
        chunks = iter(stream)
        next(chunks)
        with pytest.raises(RepriseError) as refused:
            theirs.abort("the-id")
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        done = theirs.generate(text="hi", max_new_tokens=2, request_id="the-id", session_id="the-session")
        assert done.completion_tokens == 2  # ids are per tenant: no clash, nothing learned
        assert sum(len(c.token_ids) for c in chunks) == 299  # the tenant's stream ran to its end


@pytest.mark.slow
def test_four_million_token_ids_are_refused_by_count(served, tenant, attacker) -> None:
    served.reset_peak()
    before = served.rss()
    with RepriseClient(served.grpc_target, attacker) as client, pytest.raises(RepriseError) as refused:
        client.generate(tokens=[1] * (4 * MiB - 64), max_new_tokens=4, timeout=120)
    assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert served.peak_rss() - before < 600 * MiB
    assert_unharmed(served, tenant)
