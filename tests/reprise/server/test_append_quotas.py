"""AppendTrajectory quotas over real gRPC: RESOURCE_EXHAUSTED with a RetryInfo delay the client can act
on, per tenant, counted in the metrics."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from testkit.service import start_service

from grpc_api.client import AdminClient, RepriseClient, RepriseError


@pytest.fixture
def service(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    r = start_service(tmp_path / "home", **{"server.append_calls_per_s": "4", "server.append_burst_calls": "3",
                                            "server.append_tokens_per_minute": "600"})
    yield r
    r.stop()


def test_quota_refusals_carry_the_code_and_a_retry_hint(service) -> None:
    r = service
    with AdminClient(r.target, r.admin_key) as admin:
        _, key_a = admin.create_tenant("a")
        _, key_b = admin.create_tenant("b")
    with RepriseClient(r.target, key_a) as a, RepriseClient(r.target, key_b) as b:
        for i in range(3):
            assert a.append_trajectory("s", tokens=[10 + i] * 20) == 20
        with pytest.raises(RepriseError) as exc:
            a.append_trajectory("s", tokens=[9] * 20)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate quota" in exc.value.message
        assert 0 < exc.value.retry_after_s <= 0.25  # RetryInfo: one call's refill at 4 per second
        assert b.append_trajectory("s", tokens=[7] * 20) == 20  # b has its own quotas
        time.sleep(exc.value.retry_after_s)
        assert a.append_trajectory("s", tokens=[8] * 400) == 400  # the hinted wait is enough

        time.sleep(0.3)
        with pytest.raises(RepriseError) as exc:  # 480 tokens used of 600 per minute
            a.append_trajectory("s", tokens=[8] * 200)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "600 tokens per minute" in exc.value.message
        assert 0 < exc.value.retry_after_s <= 8.01  # at most 80 tokens short, refilled at 10 per second
        time.sleep(0.3)
        with pytest.raises(RepriseError) as exc:
            b.append_trajectory("s", tokens=[8] * 700)
        assert "split it" in exc.value.message and exc.value.retry_after_s == pytest.approx(60.0)
    metrics = r.metrics()
    assert 'reprise_append_trajectory_refused_total{quota="calls"} 1.0' in metrics
    assert 'reprise_append_trajectory_refused_total{quota="tokens"} 2.0' in metrics
