"""The HTTP listener: uvicorn on the service's event loop, hardened against clients that hold
connections without finishing requests.

    server = HttpServer("127.0.0.1", 50052, HttpLimits())      # the socket is bound here
    await server.start(app)
    await server.stop()

Every connection is held to (``GuardedH11Protocol``):

- a **header deadline**: a request's headers must arrive within ``header_timeout_s`` of its first
  byte (or of the connection, for a connection that sends nothing), and its body within
  ``body_timeout_s`` of its headers; past either the connection is closed;
- **caps** on open connections per client address and in total: beyond a client's own cap its new
  connection is closed at once, before it can hold a file descriptor for long; at the total cap a new
  connection displaces the connection that has waited longest for a request's headers (one that sent
  nothing, or only part of its headers). Otherwise clients spread over many addresses would fill the
  total with half-open connections and shut everyone else out until the header deadline, again and
  again; this way a client that sends its request at once always gets in.

With the caps below the process's descriptor limit, a flood of half-open connections cannot starve
the gRPC port or the log: refusals are counted and reported once a minute (``StormLog``), as is the
event loop's own "too many open files" (which the caps keep from happening).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.storm_log import StormLog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Connection deadlines and caps (``reprise.config.ServerConfig`` has these as ``http_*`` fields)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 5.0
    max_connections: int = 1024
    max_connections_per_client: int = 256


class _CollapseRepeats(logging.Filter):
    """A filter that lets one record of each message through per interval (asyncio's accept errors)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)[:200]
        now = time.monotonic()
        if now - self._last.get(key, -float("inf")) < self.interval_s:
            self.dropped += 1
            return False
        self._last[key] = now
        return True


_COLLAPSE = _CollapseRepeats()


class ConnectionGuard:
    """The open connections per client address and in total, shared by every connection's protocol, and
    those waiting for a request's headers, oldest first (what the total cap displaces)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.by_client: dict[str, int] = {}
        self.total = 0
        self.waiting: dict[int, Callable[[], None]] = {}  # id -> close it; insertion order = oldest first
        self.refused = StormLog(log, "HTTP connections refused at the per-client connection cap")
        self.displaced = StormLog(log, "HTTP connections waiting for headers closed at the total connection cap")
        self.timed_out = StormLog(log, "HTTP connections closed for not finishing a request in time")
        self.bad_requests = StormLog(log, "HTTP requests refused as malformed (400, connection closed)")

    def admit(self, client: str) -> bool:
        mine = self.by_client.get(client, 0)
        if mine >= self.limits.max_connections_per_client:
            self.refused.hit(f"{mine} open from {client}")
            return False
        if self.total >= self.limits.max_connections:
            if not self.waiting:  # every connection is busy with a request: nothing to displace
                self.refused.hit(f"{self.total} open, all with requests")
                return False
            ident = next(iter(self.waiting))
            close = self.waiting.pop(ident)
            self.displaced.hit(f"{self.total} open")
            close()  # its connection_lost releases its count; until then the total runs one over
        self.by_client[client] = mine + 1
        self.total += 1
        return True

    def wait_for_headers(self, ident: int, close: Callable[[], None]) -> None:
        self.waiting.pop(ident, None)
        self.waiting[ident] = close

    def not_waiting(self, ident: int) -> None:
        self.waiting.pop(ident, None)

    def release(self, client: str) -> None:
        mine = self.by_client.get(client, 0) - 1
        if mine > 0:
            self.by_client[client] = mine
        else:
            self.by_client.pop(client, None)
        self.total -= 1


def low_latency(sock: socket.socket) -> None:
    """TCP_NODELAY on an accepted connection. A response leaves in two writes (its head, then its body,
    as uvicorn writes them): with Nagle's algorithm on, the second waits for the client's delayed ACK
    of the first, 40 ms on Linux, on every request of a kept-alive connection (a fresh one is still in
    quick-ACK mode, which hid it). asyncio sets it only on sockets whose ``proto`` is IPPROTO_TCP, which
    a socket made with ``socket.socket(family, SOCK_STREAM)`` is not."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FramedConnection(h11.Connection):
    """h11's server side, refusing a request whose length two readers could take differently: one with
    both Content-Length and Transfer-Encoding (a proxy that trusts Content-Length and a server that
    trusts Transfer-Encoding split the bytes into different requests: request smuggling), or with
    Transfer-Encoding in HTTP/1.0 (RFC 9112 section 6.1). h11 would read the body by Transfer-Encoding.
    ``refusal`` says why the last request was refused."""

    refusal = ""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}  # h11 gives them lowercased
            if b"transfer-encoding" in names and b"content-length" in names:
                self.refusal = ("a request may not carry both Content-Length and Transfer-Encoding "
                                "(RFC 9112 section 6.1); the connection is closed")
            elif b"transfer-encoding" in names and event.http_version == b"1.0":
                self.refusal = "Transfer-Encoding is not allowed in HTTP/1.0 (RFC 9112 section 6.1)"
            if self.refusal:
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=400)
        return event


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with ``guard``'s caps, the request deadlines (module docstring) and
    ``FramedConnection``'s check; a request refused for its framing is answered 400 and its connection
    closed, so that nothing sent after it on that connection is read as another request."""

    class GuardedH11Protocol(H11Protocol):
        _admitted = False
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: str = ""

        def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            size = config.h11_max_incomplete_event_size
            self.conn = FramedConnection(h11.SERVER, **({} if size is None else {"max_incomplete_event_size": size}))

        def send_400_response(self, msg: str) -> None:
            conn = self.conn
            refusal = conn.refusal if isinstance(conn, FramedConnection) else ""
            guard.bad_requests.hit(refusal or msg)
            super().send_400_response(refusal or msg)
            self.transport.close()  # after the answer is written: a request it could not frame ends the connection

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
            if not guard.admit(self._client):
                transport.abort()
                return
            self._admitted = True
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                low_latency(sock)
            super().connection_made(transport)
            self._arm("headers", guard.limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._admitted:
                return
            self._admitted = False
            guard.release(self._client)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE:  # a request has begun, its headers are not complete yet
                if self._waiting_for != "headers":
                    self._arm("headers", guard.limits.header_timeout_s)
            elif state is h11.SEND_BODY:
                if self._waiting_for != "body":
                    self._arm("body", guard.limits.body_timeout_s)
            else:  # the request is in (DONE), or the connection is ending
                self._disarm()

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._waiting_for = what
            self._deadline = self.loop.call_later(seconds, self._expired)
            if what == "headers":
                guard.wait_for_headers(id(self), self._displace)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if self._waiting_for in ("headers", "next request"):
                guard.not_waiting(id(self))
            self._deadline = None
            self._waiting_for = ""

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Kept alive and idle (uvicorn's keep-alive timeout closes it): displaceable like a half-open one.
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE and not self._waiting_for:
                self._waiting_for = "next request"
                guard.wait_for_headers(id(self), self._displace)

        def _displace(self) -> None:
            self._disarm()
            with contextlib.suppress(Exception):
                self.transport.abort()

        def _expired(self) -> None:
            self._deadline = None
            guard.timed_out.hit(f"waiting for {self._waiting_for}")
            self._disarm()
            with contextlib.suppress(Exception):
                self.transport.abort()

    return GuardedH11Protocol


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service owns SIGTERM/SIGINT (graceful drain)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class HttpServer:
    """An app on ``host:port`` (0 = any free port), bound at construction; ``await start(app)`` serves it
    on the running event loop, ``await stop()`` closes it."""

    def __init__(self, host: str, port: int, limits: HttpLimits | None = None) -> None:
        limits = limits or HttpLimits()
        fds = raise_fd_limit()
        # Leave half the descriptors to gRPC, the store and the model: a flood here never takes theirs.
        total = max(16, min(limits.max_connections, fds // 2))
        self.limits = HttpLimits(limits.header_timeout_s, limits.body_timeout_s, limits.keepalive_timeout_s,
                                 total, min(limits.max_connections_per_client, total))
        self.guard = ConnectionGuard(self.limits)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self._sock.listen(1024)
        self.port = self._sock.getsockname()[1]
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self, app: Any) -> int:
        for name in ("asyncio", "uvicorn.error"):
            if _COLLAPSE not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_COLLAPSE)
        config = uvicorn.Config(app, http=guarded_protocol(self.guard), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1, server_header=False,
                                timeout_keep_alive=int(max(1, self.limits.keepalive_timeout_s)),
                                h11_max_incomplete_event_size=64 * 1024)
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it
        log.info("HTTP serving on port %d", self.port)
        return self.port

    async def stop(self) -> None:
        if self._task is not None and self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)
            self._task = None
        self.close()

    def close(self) -> None:
        """Release the socket (also of a server never started)."""
        self._sock.close()
