"""The service-wide index memory budget: past it the least recently used tenant's index is evicted
(counted in the metrics and `index stats`), and the next request of that tenant rebuilds it from the
encrypted history, drafting exactly as before. A real service on an encrypted SQLite store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from testkit.service import start_service

from grpc_api.client import AdminClient, RepriseClient

BUDGET = 200_000  # bytes: one tenant's 20 turns of 60 tokens (about 145 KB with its canonical index) fit, two do not


def _turns(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 200, size=60).tolist() for _ in range(20)]


def _draft(service, tenant_id: str, prompt: list[int]) -> tuple[list[int], list[int]]:
    session = service.decoding.indexes._proposer.begin(tenant_id, "", prompt)
    tree = session.propose(16)
    session.finish(record=False)
    return tree.token_ids.tolist(), tree.parents.tolist()


@pytest.fixture
def service(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    r = start_service(tmp_path / "home", **{"server.index_memory_bytes": str(BUDGET)})
    yield r
    r.stop()


def test_eviction_under_a_small_budget_then_rebuild_drafts_the_same(service) -> None:
    r = service
    with AdminClient(r.target, r.admin_key) as admin:
        a, key_a = admin.create_tenant("a")
        b, key_b = admin.create_tenant("b")
        turns_a = _turns(1)
        with RepriseClient(r.target, key_a) as client:
            client.generate(tokens=[1, 2], max_new_tokens=1, do_not_record=True)  # a's index is in memory now
            for t in turns_a:
                client.append_trajectory("s", tokens=t)
        prompt = turns_a[3][:12]
        before = _draft(r.service, a.tenant_id, prompt)
        assert len(before[0]) > 4  # a's history drafts for this prompt
        (stats_a,) = admin.index_stats(a.tenant_id)
        assert stats_a.index_resident and stats_a.index_sequences == 20

        with RepriseClient(r.target, key_b) as client:
            client.generate(tokens=[1, 2], max_new_tokens=1, do_not_record=True)
            for t in _turns(2):
                client.append_trajectory("s", tokens=t)
        stats, memory = admin.index_stats_and_memory()
        by_id = {s.tenant_id: s for s in stats}
        assert not by_id[a.tenant_id].index_resident and by_id[b.tenant_id].index_resident
        assert memory.budget_bytes == BUDGET and memory.resident_bytes <= BUDGET and memory.num_evictions == 1
        assert "reprise_index_evictions_total 1.0" in r.metrics()
        assert "reprise_index_memory_budget_bytes 200000.0" in r.metrics()

        with RepriseClient(r.target, key_a) as client:  # a's next request rebuilds its index from the store
            client.generate(tokens=prompt, max_new_tokens=1, do_not_record=True, speculation=False)
        (stats_a,) = admin.index_stats(a.tenant_id)
        assert stats_a.index_resident and stats_a.index_sequences == 20
        assert _draft(r.service, a.tenant_id, prompt) == before
        assert not admin.index_stats(b.tenant_id)[0].index_resident  # b made room in turn


def test_victims_are_least_recently_used_never_pinned_never_the_latest() -> None:
    from reprise.server.index_budget import ResidentIndexes

    resident = ResidentIndexes(budget_bytes=100)
    for tenant, size in (("a", 40), ("b", 40), ("c", 40)):
        resident.set_size(tenant, size)
    assert resident.full
    resident.touch("a")  # order now b, c, a
    with resident.pinned("b"):
        assert resident.take_victims() == ["c"]  # b is in use
    assert resident.total_bytes == 80 and resident.num_evictions == 1 and "c" not in resident
    resident.set_size("a", 500)  # one tenant over the whole budget: its neighbours go, it stays
    assert resident.take_victims() == ["b"] and "a" in resident and resident.take_victims() == []
    assert ResidentIndexes(0).take_victims() == [] and not ResidentIndexes(0).full
    with pytest.raises(ValueError, match=">= 0 bytes"):
        ResidentIndexes(-1)
