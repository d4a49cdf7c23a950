"""What a call may hold before and after its request message (grpc_api/capacity.py), over real gRPC on
loopback with the fake backends: calls without a valid key are refused from their headers, calls that
never send their message are dropped at the pending caps or at the message deadline, and each plane
keeps its own room."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from testkit.grpc_fakes import ServerThread, Settings

from grpc_api.capacity import PendingCalls, PendingLimits, PlaneSlots, peer_address
from grpc_api.client import AdminClient, RepriseClient
from reprise.benchmarks.hostile import HalfOpenCalls
from serving import errors
from serving.records import Principal

TENANT_KEY = "rpk_tenant_a"
GENERATE = "/reprise.v1.DecodingService/Generate"
LIST_TENANTS = "/reprise.v1.AdminService/ListTenants"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# A server answering before the client sent anything may reset the stream right after its status; the
# client then sometimes reads the reset first (CANCELLED) instead of the status.
DROPPED = {"RESOURCE_EXHAUSTED", "CANCELLED"}


@pytest.fixture
def small(fakes):
    decode, admin, auth = fakes
    auth.keys[TENANT_KEY] = Principal("tenant", "a" * 32)
    st = ServerThread(decode, admin, auth, Settings(grpc_message_timeout_s=1.5, grpc_pending_per_connection=8,
                                                    grpc_pending_per_address=20, grpc_pending_total=30))
    yield st
    st.stop(0)


def others_are_served(target: str) -> float:
    """A tenant's Generate, health Check and an admin call, each on a fresh connection; the slowest's
    seconds (each must answer)."""
    slowest = 0.0
    start = time.perf_counter()
    with RepriseClient(target, TENANT_KEY) as client:
        assert client.generate(tokens=[1, 2], max_new_tokens=2, timeout=5).completion_tokens == 2
    slowest = max(slowest, time.perf_counter() - start)
    start = time.perf_counter()
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    slowest = max(slowest, time.perf_counter() - start)
    start = time.perf_counter()
    with AdminClient(target, "rpa_admin") as admin:
        admin.list_tenants()
    return max(slowest, time.perf_counter() - start)


def wait_for(calls: HalfOpenCalls, ended: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while sum(calls.outcome()["ended"].values()) < ended and time.monotonic() < deadline:
        time.sleep(0.02)
    return calls.outcome()


@pytest.mark.parametrize("method", [GENERATE, LIST_TENANTS])
@pytest.mark.parametrize("key", [None, "rpk_not_a_key", "no-prefix"])
def test_calls_without_a_valid_key_are_refused_from_their_headers(small, method, key) -> None:
    with HalfOpenCalls(small.target, method, 200, key=key) as calls:
        outcome = wait_for(calls, 200)
        assert outcome["ended"] == {"UNAUTHENTICATED": 200}, outcome  # none waited for its message
        assert others_are_served(small.target) < 2.0


def test_a_key_of_the_wrong_plane_is_refused_from_the_headers(small) -> None:
    with HalfOpenCalls(small.target, LIST_TENANTS, 50, key=TENANT_KEY) as calls:
        assert wait_for(calls, 50)["ended"] == {"PERMISSION_DENIED": 50}
    with HalfOpenCalls(small.target, GENERATE, 50, key="rpa_admin") as calls:
        assert wait_for(calls, 50)["ended"] == {"PERMISSION_DENIED": 50}


@pytest.mark.parametrize("method, key", [(HEALTH_CHECK, None), (GENERATE, TENANT_KEY)])
def test_calls_without_their_message_are_dropped_at_the_cap_then_at_the_deadline(small, method, key) -> None:
    with HalfOpenCalls(small.target, method, 100, key=key) as calls:
        outcome = wait_for(calls, 92)
        assert outcome["held"] == 8, outcome  # the per-connection cap
        assert set(outcome["ended"]) <= DROPPED and outcome["ended"].get("RESOURCE_EXHAUSTED", 0) > 80, outcome
        assert "waited longest" in outcome["messages"]["RESOURCE_EXHAUSTED"]
        assert others_are_served(small.target) < 1.0
        outcome = wait_for(calls, 100)
        assert outcome["held"] == 0 and outcome["ended"]["DEADLINE_EXCEEDED"] == 8, outcome
        assert 1.4 < outcome["ended_after_s"]["DEADLINE_EXCEEDED"] < 4.0
        assert "no request message within 1.5 s" in outcome["messages"]["DEADLINE_EXCEEDED"]
    assert others_are_served(small.target) < 1.0


def test_pending_calls_are_capped_per_address_and_in_total(small) -> None:
    with HalfOpenCalls(small.target, HEALTH_CHECK, 8, connections=5) as calls:
        outcome = wait_for(calls, 20)
        assert outcome["held"] == 20, outcome  # 8 per connection, 20 from this address
        # a client that sends its message at once always gets in: the longest-waiting call makes room
        assert others_are_served(small.target) < 1.0
    pending = small.server.capacity.pending
    assert small.on_loop(lambda: pending.num_pending) == 0


def test_a_call_that_closes_without_its_message_is_refused(small) -> None:
    with grpc.insecure_channel(small.target) as ch:
        call = ch.stream_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as exc:
            call(iter(()), timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no request message" in exc.value.details()


def test_planes_have_their_own_caps() -> None:
    slots = PlaneSlots({"data": 2, "admin": 1, "public": 1})
    slots.acquire("data")
    slots.acquire("data")
    with pytest.raises(errors.ResourceExhausted) as exc:
        slots.acquire("data")
    assert exc.value.retry_after_s > 0 and "data-plane" in exc.value.message
    slots.acquire("admin")  # the other planes are untouched
    slots.acquire("public")
    slots.release("data")
    slots.acquire("data")
    assert slots.refused.total == 1


def test_the_longest_waiting_pending_call_is_dropped_first() -> None:
    async def scenario() -> list[str]:
        pending = PendingCalls(PendingLimits(per_connection=2, per_address=3, total=4, timeout_s=5))
        never = asyncio.Event()

        class Silent:
            def __aiter__(self):
                return self

            async def __anext__(self):
                await never.wait()
                raise StopAsyncIteration

        order: list[str] = []

        async def call(name: str, peer: str) -> None:
            try:
                await pending.first_message(peer, Silent())
            except errors.ResourceExhausted:
                order.append(name)

        tasks = []
        for name, peer in [("a1", "ipv4:1.1.1.1:1"), ("a2", "ipv4:1.1.1.1:1"), ("a3", "ipv4:1.1.1.1:1"),
                           ("b1", "ipv4:1.1.1.1:2"), ("b2", "ipv4:1.1.1.1:2"), ("c1", "ipv4:2.2.2.2:1"),
                           ("d1", "ipv4:3.3.3.3:1")]:
            tasks.append(asyncio.ensure_future(call(name, peer)))
            await asyncio.sleep(0.01)
        assert pending.num_pending == 4
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert pending.num_pending == 0
        return order

    # a1 for a3 (its connection's cap), a2 for b2 (its address's cap), a3 for d1 (the total cap)
    assert asyncio.run(scenario()) == ["a1", "a2", "a3"]


def test_peer_address() -> None:
    assert peer_address("ipv4:127.0.0.1:5000") == "ipv4:127.0.0.1"
    assert peer_address("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert peer_address("unix:/tmp/socket") == "unix:/tmp/socket"
