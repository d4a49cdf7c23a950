"""Issue 36, item 6, from outside: a request whose length a proxy and the server could read differently
(both Content-Length and Transfer-Encoding; Transfer-Encoding in HTTP/1.0) once kept its connection
open, and the request smuggled after it was answered. Now it is refused (400) and its connection closed;
well-framed pipelined requests are still answered in order."""

from __future__ import annotations

import json

import pytest
from testkit.hostile import assert_unharmed

from reprise.benchmarks.hostile import exchange


def chat(key: str, framing: bytes, version: bytes = b"1.1") -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    return (b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n" + framing + b"\r\n" + chunked)


def smuggled(key: str) -> bytes:
    return b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n"


@pytest.mark.parametrize("framing, version", [
    (b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", b"1.1"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 400\r\n", b"1.1"),
    (b"transfer-encoding: Chunked\r\ncontent-length: 0\r\n", b"1.1"),
    (b"Transfer-Encoding: chunked\r\n", b"1.0"),
])
def test_a_request_with_two_framings_is_refused_and_its_connection_closed(served, tenant, attacker, framing,
                                                                           version) -> None:
    out = exchange(served.http_port, chat(attacker, framing, version) + smuggled(attacker))
    assert out.startswith(b"HTTP/1.1 400 "), out[:300]
    assert b"RFC 9112 section 6.1" in out and b"connection: close" in out.lower()
    assert b'"object":"list"' not in out and not out.endswith(b"<open>")  # the smuggled request was not read
    assert_unharmed(served, tenant)


@pytest.mark.parametrize("framing", [
    b"Content-Length: 4\r\nContent-Length: 5\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n",
    b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
    b"Content-Length: -1\r\n",
])
def test_other_bad_framings_are_refused_and_their_connection_closed(served, tenant, attacker, framing) -> None:
    out = exchange(served.http_port, chat(attacker, framing) + smuggled(attacker))
    assert out.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 501 ")), out[:300]
    assert b'"object":"list"' not in out and not out.endswith(b"<open>")
    assert_unharmed(served, tenant)


def test_well_framed_pipelined_requests_are_answered_in_order(served, tenant) -> None:
    first = chat(tenant, b"Transfer-Encoding: chunked\r\n")
    out = exchange(served.http_port, first + smuggled(tenant) + b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                   b"Connection: close\r\n\r\n", timeout=30)
    assert out.count(b"HTTP/1.1 ") == out.count(b"HTTP/1.1 200 OK") == 3, out[:500]
    assert out.index(b'"chat.completion"') < out.index(b'"object":"list"') < out.index(b"serving")
