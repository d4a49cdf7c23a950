"""Issue 36, item 1, from outside: gRPC calls that send their headers and never their message. 450 such
anonymous calls on one connection once held every one of grpc's ``maximum_concurrent_rpcs`` slots, and
for as long as they were held every new call (health, Generate, the admin plane) was refused. Now a call
without a valid key is refused from its headers, a call that may wait (health needs no key; a tenant's
own calls) waits under per-connection and per-address caps and a deadline, and health, tenants and the
admin plane answer within a second all through."""

from __future__ import annotations

import time

import pytest
from testkit.hostile import assert_unharmed

from reprise.benchmarks.hostile import HalfOpenCalls

GENERATE = "/reprise.v1.DecodingService/Generate"
GENERATE_STREAM = "/reprise.v1.DecodingService/GenerateStream"
APPEND = "/reprise.v1.DecodingService/AppendTrajectory"
LIST_TENANTS = "/reprise.v1.AdminService/ListTenants"
IMPORT_HISTORY = "/reprise.v1.AdminService/ImportHistory"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# A server answering before the client sent anything may reset the stream right after its status; a
# client sometimes reads the reset first (CANCELLED) instead of the status.
DROPPED = {"RESOURCE_EXHAUSTED", "CANCELLED"}


def ended(calls: HalfOpenCalls, count: int, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while sum(calls.outcome()["ended"].values()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return calls.outcome()


def served_within_a_second(served, tenant) -> dict:
    """A tenant's Generate and chat, both health checks (and each plane's on both fronts) and the admin
    plane, all answered, the gRPC ones within 1 s."""
    seen = assert_unharmed(served, tenant)
    for name in ("grpc_generate", "grpc_health", "admin_list_tenants", "healthz"):
        assert seen[name][1] < 1.0, seen
    return seen


@pytest.mark.parametrize("methods", [[GENERATE, LIST_TENANTS, GENERATE_STREAM, APPEND, IMPORT_HISTORY]])
@pytest.mark.parametrize("key", [None, "rpk_made_up_key", "rpa_made_up_admin_key"])
def test_calls_without_a_valid_key_hold_nothing(served, tenant, methods, key) -> None:
    log_before = len(served.log())
    with HalfOpenCalls(served.grpc_target, methods, 450, key=key) as calls:
        outcome = ended(calls, 450)
        assert outcome["ended"] == {"UNAUTHENTICATED": 450}, outcome  # at once, from the headers
        assert max(outcome["ended_after_s"].values()) < 10.0, outcome
        served_within_a_second(served, tenant)
    log = served.log()[log_before:]
    assert log.count("\n") < 10, log[-2000:]  # a line a minute, not one per call
    assert "gRPC calls refused before their message: missing, malformed or unknown credentials" in served.log()


def test_a_tenant_key_on_the_admin_plane_holds_nothing(served, tenant, attacker) -> None:
    with HalfOpenCalls(served.grpc_target, LIST_TENANTS, 450, key=attacker) as calls:
        assert ended(calls, 450)["ended"] == {"PERMISSION_DENIED": 450}
        served_within_a_second(served, tenant)


@pytest.mark.parametrize("method, who", [(HEALTH_CHECK, None), (GENERATE, "attacker"), (GENERATE_STREAM, "attacker"),
                                         (APPEND, "attacker")])
def test_calls_that_may_wait_are_capped_per_connection_and_timed_out(served, tenant, attacker, method, who) -> None:
    key = attacker if who == "attacker" else None
    with HalfOpenCalls(served.grpc_target, method, 450, key=key) as calls:
        outcome = ended(calls, 450 - 32)
        assert outcome["held"] == 32, outcome  # server.grpc_pending_per_connection
        assert set(outcome["ended"]) <= DROPPED and outcome["ended"].get("RESOURCE_EXHAUSTED", 0) > 400, outcome
        seen = served_within_a_second(served, tenant)  # while 32 are held
        outcome = ended(calls, 450)
        # the deadline (2 s here, server.grpc_message_timeout_s) ends the rest
        assert outcome["held"] == 0 and outcome["ended"]["DEADLINE_EXCEEDED"] == 32, outcome
        assert "no request message within 2 s" in outcome["messages"]["DEADLINE_EXCEEDED"]
    assert seen["health reprise.v1.DecodingService"] == ("SERVING", "200 serving")
    assert_unharmed(served, tenant)


def test_many_connections_from_one_address_are_capped_together(served, tenant) -> None:
    with HalfOpenCalls(served.grpc_target, HEALTH_CHECK, 32, connections=12) as calls:  # 384 calls
        outcome = ended(calls, 384 - 128)
        assert outcome["held"] <= 128, outcome  # server.grpc_pending_per_address
        # the normal tenant comes from the same address: the longest-waiting calls made room for it
        served_within_a_second(served, tenant)
    assert_unharmed(served, tenant)


@pytest.mark.slow
def test_a_flood_renewed_on_every_plane(served, tenant) -> None:
    """Anonymous calls to every plane on several connections, renewed while others ask: 1,800 calls at a
    time, of which at most 128 health checks are held (the per-address cap), the rest refused or dropped."""
    for _ in range(3):
        with HalfOpenCalls(served.grpc_target, [GENERATE, LIST_TENANTS, HEALTH_CHECK], 450, connections=4) as anon:
            assert 0 < ended(anon, 1800 - 128)["held"] <= 128
            served_within_a_second(served, tenant)
    assert_unharmed(served, tenant)
