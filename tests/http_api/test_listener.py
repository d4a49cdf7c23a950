"""The hardened HTTP listener (http_api/server.py) in-process, on loopback, with a small app: requests
whose framing two readers could take differently are refused and their connections closed, and every
accepted connection has TCP_NODELAY."""

from __future__ import annotations

import socket

import pytest
from testkit.service import LoopThread

from http_api import server as listener
from http_api.server import HttpServer
from reprise.benchmarks.hostile import exchange


async def echo_length(scope, receive, send) -> None:
    """An ASGI app answering with the length of the request body it read."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    reply = f"{scope['path']} {len(body)}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(reply)).encode())]})
    await send({"type": "http.response.body", "body": reply})


@pytest.fixture
def http():
    loop = LoopThread()
    server = HttpServer("127.0.0.1", 0)
    loop.call(server.start(echo_length))
    yield server
    loop.call(server.stop())
    loop.close()


SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("head", [
    # a proxy reading Content-Length sees one request; Transfer-Encoding ends the body at "0" and leaves
    # the next request in the same bytes
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\ncontent-length: 5\r\ntransfer-encoding: CHUNKED\r\n\r\n",
    b"POST /a HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
])
def test_ambiguous_framing_is_refused_and_the_connection_closed(http, head) -> None:
    out = exchange(http.port, head + b"0\r\n\r\n" + SMUGGLED)
    assert out.startswith(b"HTTP/1.1 400 "), out
    assert b"connection: close" in out.lower() and b"RFC 9112 section 6.1" in out
    assert b"/smuggled" not in out and not out.endswith(b"<open>")  # nothing after it was answered


@pytest.mark.parametrize("head", [
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 6\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n",
])
def test_other_malformed_framing_is_refused_and_the_connection_closed(http, head) -> None:
    out = exchange(http.port, head + b"0\r\n\r\n" + SMUGGLED)
    assert out.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 501 ")), out
    assert b"/smuggled" not in out and not out.endswith(b"<open>")


def test_well_framed_requests_are_still_pipelined(http) -> None:
    chunked = b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    sized = b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    out = exchange(http.port, chunked + sized + SMUGGLED + b"GET /d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answers = [part.split(b"\r\n\r\n", 1)[1] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
    assert answers == [b"/b 5", b"/c 3", b"/smuggled 0", b"/d 0"]


def test_every_accepted_connection_has_tcp_nodelay(http, monkeypatch) -> None:
    seen: list[int] = []
    original = listener.low_latency

    def record(sock: socket.socket) -> None:
        original(sock)
        seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(listener, "low_latency", record)
    for _ in range(3):
        assert exchange(http.port, b"GET /e HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").endswith(b"/e 0")
    assert seen == [1, 1, 1]
