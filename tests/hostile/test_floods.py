"""Issue 22, items 3 and 4, from outside, without a key: idle anonymous gRPC streams (Health.Watch,
reflection) beyond every cap, and half-open HTTP connections (headers never finished) beyond the
per-client cap. The attacker is refused (RESOURCE_EXHAUSTED with a retry delay; connections closed),
a normal tenant's Generate and chat and both health checks answer during the flood and after it, the
server's descriptors come back, and its log reports the storm a few times, not once per connection."""

from __future__ import annotations

import time

import pytest
from testkit.hostile import assert_unharmed

from reprise.benchmarks.hostile import (
    attacker_sources,
    close_all,
    half_open,
    idle_streams,
    raise_fd_limit,
    still_open,
)


@pytest.mark.parametrize("kind", ["watch", "reflection"])
def test_idle_anonymous_streams_never_take_tenants_capacity(served, tenant, kind) -> None:
    streams = idle_streams(served.grpc_target, 200, per_channel=8, kind=kind)
    try:
        # 32 in all, 4 per connection: the rest are refused with a retry delay (RetryInfo)
        assert streams.held <= 32 and streams.held >= 4, streams.held
        assert streams.refused.get("RESOURCE_EXHAUSTED", 0) == 200 - streams.held, streams.refused
        assert streams.retry_hints == 200 - streams.held
        seen = assert_unharmed(served, tenant)  # while the attacker's streams are open
        assert seen["grpc_health"][1] < 2.0 and seen["grpc_generate"][1] < 10.0, seen
    finally:
        streams.close()
    assert_unharmed(served, tenant)


def test_half_open_http_connections_are_capped_and_timed_out(served, tenant) -> None:
    fds_before = served.num_fds()
    log_before = len(served.log())
    # 300 connections from one address: 64 are admitted (the per-client cap), the rest closed at once
    held = half_open(served.http, 300, attacker_sources(1))
    try:
        time.sleep(0.3)
        assert still_open(held) <= 64
        seen = assert_unharmed(served, tenant)  # from 127.0.0.1, another client
        assert seen["healthz"][1] < 2.0 and seen["grpc_health"][1] < 2.0, seen
        time.sleep(2.5)  # past the 2 s header deadline: the admitted ones are closed too
        assert still_open(held) == 0
    finally:
        close_all(held)
    deadline = time.monotonic() + 10
    while served.num_fds() > fds_before + 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served.num_fds() <= fds_before + 8
    storm = served.log()[log_before:]
    assert storm.count("\n") < 20, storm[-2000:]  # a report per storm, not a line per connection
    assert "Too many open files" not in storm
    assert_unharmed(served, tenant)


def test_slow_body_is_cut_at_its_deadline(served, tenant) -> None:
    """Slowloris on the body: complete headers, a Content-Length, then a byte now and then."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\nAuthorization: Bearer " + tenant.encode() + b"\r\n\r\n{")
    held = half_open(served.http, 40, attacker_sources(1), head=head)
    try:
        start = time.monotonic()
        while still_open(held) and time.monotonic() - start < 10:
            for s in held:
                try:
                    s.setblocking(True)
                    s.settimeout(0.01)
                    s.send(b" ")
                except OSError:
                    pass
            time.sleep(0.5)
        assert still_open(held) == 0 and time.monotonic() - start < 6  # the 3 s body deadline
    finally:
        close_all(held)
    assert_unharmed(served, tenant)


def test_half_open_flood_from_many_addresses_cannot_fill_the_total(served, tenant) -> None:
    """10 addresses x 64 half-open connections, beyond the total cap of 400: new connections displace the
    oldest of those waiting for headers, so a client that sends its request at once still gets in."""
    held = half_open(served.http, 640, attacker_sources(10))
    try:
        deadline = time.monotonic() + 1.5  # within the header deadline: the server has accepted them all
        while still_open(held) > 400 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert still_open(held) <= 400
        for _ in range(3):  # keep the flood topped up between the tenant's requests
            held += half_open(served.http, 100, attacker_sources(10)[5:])
            seen = assert_unharmed(served, tenant)
            assert seen["healthz"][1] < 2.0, seen
    finally:
        close_all(held)
    assert "closed at the total connection cap" in served.log()


def test_idle_keep_alive_connections_are_displaced_too(served, tenant) -> None:
    """Connections that finish one request and then sit idle (keep-alive) over many addresses."""
    import http.client

    idle = []
    for source in attacker_sources(8):
        for _ in range(60):
            conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=5, source_address=(source, 0))
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                idle.append(conn)
            except OSError:
                conn.close()
    try:
        assert len(idle) >= 400
        assert_unharmed(served, tenant)
    finally:
        close_all(idle)


@pytest.mark.slow
def test_thousands_of_half_open_connections(served, tenant) -> None:
    """The issue's flood at scale: 4,000 half-open connections from 20 addresses, topped up while a
    normal tenant asks; the server's descriptors stay under its caps and come back afterwards."""
    raise_fd_limit()
    fds_before = served.num_fds()
    held = half_open(served.http, 4000, attacker_sources(20))
    try:
        for _ in range(3):
            held += half_open(served.http, 500, attacker_sources(20))
            seen = assert_unharmed(served, tenant)
            assert seen["healthz"][1] < 2.0 and seen["grpc_health"][1] < 2.0, seen
            assert served.num_fds() < fds_before + 400 + 64  # the total cap (400) and some slack
    finally:
        close_all(held)
    deadline = time.monotonic() + 15
    while served.num_fds() > fds_before + 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served.num_fds() <= fds_before + 8
    assert "Too many open files" not in served.log()


@pytest.mark.slow
def test_four_hundred_idle_streams_of_each_kind_at_once(served, tenant) -> None:
    watch = idle_streams(served.grpc_target, 400, per_channel=4, kind="watch")
    reflection = idle_streams(served.grpc_target, 400, per_channel=4, kind="reflection")
    try:
        assert watch.held + reflection.held <= 32
        seen = assert_unharmed(served, tenant)
        assert seen["grpc_health"][1] < 2.0, seen
    finally:
        watch.close()
        reflection.close()
    assert_unharmed(served, tenant)
