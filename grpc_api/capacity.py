"""What a gRPC call may hold, and for how long, before and after its request message arrives.

grpc counts a call from its headers, before its message; its own ``maximum_concurrent_rpcs`` is one
count for every service, so calls that send headers and never a message (anonymous ones included) once
held all of it and shut out health checks, tenants and the admin plane alike. The server therefore runs
without it, and the interceptor (``grpc_api.interceptors``) holds every call to these instead:

- ``PendingCalls``: calls whose request message has not arrived yet, capped per connection, per peer
  address and in total. At a cap the call that has waited longest for its message is dropped
  (RESOURCE_EXHAUSTED with a retry delay), never the new one: a client that sends its message at once
  (every real client) is pending for microseconds and always gets in. A call still without its message
  after ``timeout_s`` is ended with DEADLINE_EXCEEDED. Credentials are checked from the headers before a
  call gets this far, so a call without a valid key never waits here.
- ``PlaneSlots``: calls at work, once their message is in, counted per plane (data, admin, public), so
  no plane's calls can take another plane's room.
- ``PublicStreams``: the long-lived streams anyone may open without a key (``Health.Watch``,
  reflection), per connection and in total.

Every refusal is counted and logged once a minute per kind (``serving.storm_log``). All of it runs on
the server's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from serving import errors
from serving.storm_log import StormLog

log = logging.getLogger(__name__)

PLANES = ("data", "admin", "public")


def peer_address(peer: str) -> str:
    """The client address of a grpc peer string (``ipv4:127.0.0.1:5000`` -> ``ipv4:127.0.0.1``,
    ``ipv6:[::1]:5000`` -> ``ipv6:[::1]``); the peer string itself names one connection."""
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() and head.count(":") >= 1 else peer


class MessageTimeout(Exception):
    """A call's request message did not arrive within ``PendingCalls.timeout_s``."""


@dataclass(eq=False)
class _Pending:
    connection: str
    address: str
    dropped: asyncio.Future = field(repr=False)


@dataclass(frozen=True, slots=True)
class PendingLimits:
    """Caps on calls waiting for their request message (``reprise.config.ServerConfig``'s
    ``grpc_pending_*`` and ``grpc_message_timeout_s``)."""

    per_connection: int = 32
    per_address: int = 128
    total: int = 1024
    timeout_s: float = 10.0


class PendingCalls:
    """Calls that have sent their headers and not yet their request message (module docstring)."""

    def __init__(self, limits: PendingLimits) -> None:
        self.limits = limits
        self._all: dict[int, _Pending] = {}  # insertion order: the oldest first
        self._by_connection: dict[str, dict[int, _Pending]] = {}
        self._by_address: dict[str, dict[int, _Pending]] = {}
        self._ids = itertools.count()
        self.dropped = StormLog(log, "gRPC calls dropped while waiting for their request message at a pending-call cap")
        self.timed_out = StormLog(log, "gRPC calls ended for not sending their request message in time")

    @property
    def num_pending(self) -> int:
        return len(self._all)

    async def first_message(self, peer: str, requests: AsyncIterator[Any]) -> Any:
        """The call's first request message (``StopAsyncIteration`` when the client sent none), waited
        for under the caps and the deadline: ``errors.ResourceExhausted`` when the call is dropped at a
        cap, ``MessageTimeout`` when its message is late."""
        ident, pending = self._enter(peer)
        read = asyncio.ensure_future(requests.__anext__())
        try:
            done, _ = await asyncio.wait((read, pending.dropped), timeout=self.limits.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if read in done:
                return read.result()
            if pending.dropped in done:
                raise errors.ResourceExhausted(pending.dropped.result(), retry_after_s=1.0)
            self.timed_out.hit(f"{self.limits.timeout_s:g} s; from {peer}")
            raise MessageTimeout(f"no request message within {self.limits.timeout_s:g} s of the call's headers")
        finally:
            if not read.done():
                read.cancel()
            self._leave(ident, pending)

    def _enter(self, peer: str) -> tuple[int, _Pending]:
        address = peer_address(peer)
        limits = self.limits
        mine = self._by_connection.setdefault(peer, {})
        theirs = self._by_address.setdefault(address, {})
        for group, cap, where in ((mine, limits.per_connection, "on its connection"),
                                  (theirs, limits.per_address, f"from {address}"),
                                  (self._all, limits.total, "on the server")):
            while len(group) >= cap:
                oldest_id, oldest = next(iter(group.items()))
                self._drop(oldest_id, oldest, f"dropped: {cap} calls {where} were waiting for their request "
                                              "message and this one had waited longest; send the message with "
                                              "the headers")
        ident = next(self._ids)
        pending = _Pending(peer, address, asyncio.get_running_loop().create_future())
        self._all[ident] = mine[ident] = theirs[ident] = pending
        return ident, pending

    def _drop(self, ident: int, pending: _Pending, reason: str) -> None:
        self._leave(ident, pending)
        if not pending.dropped.done():
            pending.dropped.set_result(reason)
        self.dropped.hit(f"from {pending.connection}")

    def _leave(self, ident: int, pending: _Pending) -> None:
        if self._all.pop(ident, None) is None:
            return
        for groups, key in ((self._by_connection, pending.connection), (self._by_address, pending.address)):
            group = groups[key]
            del group[ident]
            if not group:
                del groups[key]


class PlaneSlots:
    """Calls at work per plane (``PLANES``), each plane with its own cap: beyond it RESOURCE_EXHAUSTED
    with a retry delay, and the other planes are untouched."""

    def __init__(self, caps: dict[str, int]) -> None:
        self.caps = dict(caps)
        self.in_use = dict.fromkeys(self.caps, 0)
        self.refused = StormLog(log, "gRPC calls refused at a plane's cap on calls in flight")

    def acquire(self, plane: str) -> None:
        if self.in_use[plane] >= self.caps[plane]:
            self.refused.hit(f"{plane} plane, {self.caps[plane]} in flight")
            raise errors.ResourceExhausted(f"the server has {self.caps[plane]} {plane}-plane calls in flight; "
                                           "retry shortly", retry_after_s=1.0)
        self.in_use[plane] += 1

    def release(self, plane: str) -> None:
        self.in_use[plane] -= 1


class PublicStreams:
    """Caps on the streams anyone may open without a key, in total and per connection (the peer string:
    one HTTP/2 connection)."""

    def __init__(self, max_total: int, max_per_connection: int) -> None:
        self.max_total = max_total
        self.max_per_connection = max_per_connection
        self._by_peer: dict[str, int] = {}
        self._total = 0
        self.refused = 0
        self._log = StormLog(log, "anonymous gRPC streams (health Watch, reflection) refused at their caps")

    @property
    def num_open(self) -> int:
        return self._total

    def acquire(self, peer: str) -> None:
        mine = self._by_peer.get(peer, 0)
        if mine >= self.max_per_connection or self._total >= self.max_total:
            self.refused += 1
            limit = (f"{self.max_per_connection} per connection" if mine >= self.max_per_connection
                     else f"{self.max_total} in all")
            self._log.hit(limit)
            raise errors.ResourceExhausted(f"too many open health-watch or reflection streams ({limit})",
                                           retry_after_s=5.0)
        self._by_peer[peer] = mine + 1
        self._total += 1

    def release(self, peer: str) -> None:
        mine = self._by_peer.get(peer, 0) - 1
        if mine > 0:
            self._by_peer[peer] = mine
        else:
            self._by_peer.pop(peer, None)
        self._total -= 1


@dataclass
class Capacity:
    """Everything a gRPC call is held to, shared by every call of one server."""

    pending: PendingCalls
    planes: PlaneSlots
    public_streams: PublicStreams
    unauthenticated: StormLog = field(default_factory=lambda: StormLog(
        log, "gRPC calls refused before their message: missing, malformed or unknown credentials"))

    @classmethod
    def for_settings(cls, settings: Any) -> Capacity:
        """From ``reprise.config.ServerConfig`` (or any object with its fields)."""
        pending = PendingLimits(settings.grpc_pending_per_connection, settings.grpc_pending_per_address,
                                settings.grpc_pending_total, settings.grpc_message_timeout_s)
        # Generation is admitted by the serving core (per tenant and in total); this cap is a last guard
        # above what admission lets through, plus room for short calls (model info, aborts, appends).
        caps = {"data": settings.max_concurrent_requests * 2 + 256, "admin": settings.admin_max_calls,
                "public": 256}
        return cls(PendingCalls(pending), PlaneSlots(caps),
                   PublicStreams(settings.public_streams_total, settings.public_streams_per_connection))


def default_capacity() -> Capacity:
    """The defaults of ``reprise.config.ServerConfig`` (for a server built without settings)."""
    return Capacity(PendingCalls(PendingLimits()), PlaneSlots({"data": 384, "admin": 64, "public": 256}),
                    PublicStreams(64, 4))

