"""A tenant at its own limits: requests in flight beyond ``max_requests_per_tenant`` (8 here, with 4
engine slots) and AppendTrajectory beyond its quotas are refused with a retry delay (HTTP 429 +
Retry-After, gRPC RESOURCE_EXHAUSTED + RetryInfo), and only that tenant is refused: a normal tenant is
served meanwhile."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest
from testkit.hostile import assert_unharmed

from grpc_api.client import RepriseClient, RepriseError
from reprise.benchmarks.hostile import http_call

USER = [{"role": "user", "content": "hi"}]


def test_requests_beyond_the_tenants_limit_get_a_retry_delay(served, tenant) -> None:
    key = served.create_tenant("greedy")
    conns = []
    try:
        for _ in range(8):  # the tenant's limit, held by long streams
            conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=30)
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"messages": USER, "max_tokens": 300, "ignore_eos": True, "stream": True}),
                {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            assert conn.getresponse().status == 200
            conns.append(conn)
        status, headers, doc = http_call(served.http, "POST", "/v1/chat/completions",
                                         {"messages": USER, "max_tokens": 4}, key=key)
        assert status == 429 and int(headers["retry-after"]) >= 1 and doc["error"]["type"] == "rate_limit_error"
        with RepriseClient(served.grpc_target, key) as client, pytest.raises(RepriseError) as refused:
            client.generate(text="hi", max_new_tokens=4)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.retry_after_s
        # Another tenant is not held to this one's limit: its request waits for the first of the 4 slots
        # to free (a 300-token stream); the engine then serves it before the greedy tenant's queued ones
        # (tests/reprise/engine/test_engine.py, test_free_slots_go_to_the_tenant_holding_fewest).
        assert_unharmed(served, tenant)
    finally:
        for conn in conns:
            conn.close()


def test_append_trajectory_floods_meet_the_quota(served, tenant) -> None:
    key = served.create_tenant("appender")
    with RepriseClient(served.grpc_target, key) as client:
        with pytest.raises(RepriseError) as refused:  # a turn beyond the context: refused by its count
            client.append_trajectory("s", tokens=[1 + i % 200 for i in range(1_100_000)])
        assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
        codes = []
        for _ in range(140):  # bursts of 100 calls, then 20 per second
            try:
                client.append_trajectory("s", tokens=[1 + i % 200 for i in range(500)])
                codes.append("OK")
            except RepriseError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.retry_after_s, exc
                codes.append(exc.code.name)
        assert codes.count("OK") >= 100 and "RESOURCE_EXHAUSTED" in codes, codes
    assert_unharmed(served, tenant)
