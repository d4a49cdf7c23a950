"""The store's behaviour on both backends: tenants, trajectories in commit order, blobs, restarts,
isolation between tenants, and what bad input gets."""

from __future__ import annotations

import numpy as np
import pytest

from privacy import (
    Tenant,
    TenantExistsError,
    TenantId,
    Trajectory,
    UnknownTenantError,
    open_store,
)


def test_tenant_create_find_list(store) -> None:
    a = store.create_tenant("acme-corp")
    b = store.create_tenant("Beta_2.team")
    assert isinstance(a, Tenant) and a.id != b.id and a.data_key_version == 1
    assert store.get_tenant(a.id) == a
    assert store.find_tenant("ACME-CORP") == a  # names are unique regardless of case
    assert store.find_tenant("nobody") is None
    assert [t.id for t in store.list_tenants()] == [a.id, b.id]
    with pytest.raises(TenantExistsError):
        store.create_tenant("Acme-Corp")


@pytest.mark.parametrize("name", ["", "-lead", "has space", "x" * 64, "ünïcode", "semi;colon", 7,
                                  "0123456789abcdef0123456789abcdef", "0123456789ABCDEF0123456789abcdef"])
def test_bad_tenant_names(store, name) -> None:
    with pytest.raises(ValueError, match="tenant name"):
        store.create_tenant(name)


def test_tenant_id_is_opaque_frozen_and_validated() -> None:
    tid = TenantId.generate()
    assert len(tid.value) == 32 and str(tid) == tid.value and len(tid.raw) == 16
    with pytest.raises(AttributeError):
        tid.value = "0" * 32  # type: ignore[misc]
    assert not hasattr(tid, "__dict__")  # slotted
    for bad in ["acme", "0" * 31, "G" * 32, "A" * 32]:
        with pytest.raises(ValueError, match="tenant id"):
            TenantId(bad)


def _traj(i: int, session: str = "s") -> Trajectory:
    rng = np.random.default_rng(i)
    ids = rng.integers(0, 100_000 if i % 2 else 50_000, size=int(rng.integers(0, 200)))
    return Trajectory(session, ids, f"text {i} ✓", num_prompt_tokens=len(ids) // 2, started_at=float(i),
                      finished_at=float(i) + 0.5)


def test_trajectories_come_back_in_commit_order(store) -> None:
    t = store.create_tenant("acme").id
    written = [_traj(i, f"session-{i % 3}") for i in range(40)]
    refs = [store.append_trajectories(t, [w])[0] for w in written[:10]]
    refs += store.append_trajectories(t, written[10:])  # one atomic batch
    records = list(store.iter_trajectories(t, batch_size=7))
    assert [r.trajectory for r in records] == written
    assert [r.cursor for r in records] == [ref.cursor for ref in refs]
    assert [r.record_id for r in records] == [ref.record_id for ref in refs]
    assert store.count_trajectories(t) == 40
    after = list(store.iter_trajectories(t, after=refs[29].cursor))
    assert [r.trajectory for r in after] == written[30:]
    one = list(store.iter_trajectories(t, session_id="session-1", batch_size=4))
    assert [r.trajectory for r in one] == [w for w in written if w.session_id == "session-1"]
    assert list(store.iter_trajectories(t, session_id="no-such-session")) == []


def test_append_trajectory_defaults_and_empty(store) -> None:
    t = store.create_tenant("acme").id
    ref = store.append_trajectory(t, "", [])
    (rec,) = store.iter_trajectories(t)
    assert rec.cursor == ref.cursor and rec.trajectory.token_ids.size == 0 and rec.trajectory.text == ""
    assert rec.trajectory.finished_at > 0  # defaults to now
    assert store.append_trajectories(t, []) == []


def test_bad_trajectory_inputs(store) -> None:
    t = store.create_tenant("acme").id
    with pytest.raises(TypeError, match="dtype float"):
        store.append_trajectory(t, "s", np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="-3"):
        store.append_trajectory(t, "s", [1, -3])
    with pytest.raises(ValueError, match="2\\^31"):
        store.append_trajectory(t, "s", [2**31])
    with pytest.raises(ValueError, match="one-dimensional"):
        store.append_trajectory(t, "s", [[1, 2]])
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        store.append_trajectory(t, "s", [1, 2], num_prompt_tokens=3)
    with pytest.raises(TypeError, match="session_id"):
        store.append_trajectory(t, 42, [1])
    with pytest.raises(TypeError, match="TenantId"):
        store.append_trajectory(t.value, "s", [1])  # a bare string is never a tenant
    with pytest.raises(TypeError, match="Trajectory"):
        store.append_trajectories(t, [("s", [1])])
    with pytest.raises(UnknownTenantError):
        store.append_trajectory(TenantId.generate(), "s", [1])
    with pytest.raises(ValueError, match="cursor"):
        list(store.iter_trajectories(t, after="not-a-cursor"))
    with pytest.raises(ValueError, match="batch_size"):
        store.iter_trajectories(t, batch_size=0)
    assert store.count_trajectories(t) == 0  # nothing half-written by the failures


def test_snapshots_corpora_hidden_states(make_config, master_env) -> None:
    store = open_store(make_config(chunk_bytes=4096), env=master_env)
    t = store.create_tenant("acme").id
    assert store.get_snapshot(t) is None
    data = np.random.default_rng(0).bytes(20_000)  # five chunks
    store.put_snapshot(t, data, cursor="7")
    snap = store.get_snapshot(t)
    assert snap.data == data and snap.cursor == "7" and snap.name == "default"
    store.put_snapshot(t, b"newer", cursor="9")
    store.put_snapshot(t, b"", name="empty")
    assert store.get_snapshot(t).data == b"newer" and store.get_snapshot(t, "empty").data == b""
    assert store.delete_snapshot(t, "empty") and store.get_snapshot(t, "empty") is None
    with pytest.raises(TypeError, match="bytes"):
        store.put_snapshot(t, "text")
    with pytest.raises(TypeError, match="snapshot name"):
        store.get_snapshot(t, name=7)
    with pytest.raises(TypeError, match="cursor"):
        store.put_snapshot(t, b"x", cursor=12)
    with pytest.raises(ValueError, match="at most 4096"):
        store.put_snapshot(t, b"x", name="n" * 5000)
    with pytest.raises(TypeError, match="corpus name"):
        store.iter_corpus(t, None)
    with pytest.raises(TypeError, match="hidden-state key"):
        store.get_hidden_states(t, b"key")

    docs = [np.arange(5), [7, 8, 70_000], []]
    info = store.add_corpus_documents(t, docs, name="docs")
    assert (info.num_documents, info.num_tokens, info.num_parts) == (3, 8, 1)
    info = store.add_corpus_documents(t, [[1, 2]], name="docs")
    assert (info.num_documents, info.num_tokens, info.num_parts) == (4, 10, 2)
    got = list(store.iter_corpus(t, "docs"))
    assert [d.tolist() for d in got] == [list(range(5)), [7, 8, 70_000], [], [1, 2]]
    assert store.add_corpus_documents(t, [[9]], name="docs", replace=True).num_documents == 1
    store.add_corpus_documents(t, [[3]])
    assert [c.name for c in store.list_corpora(t)] == ["default", "docs"]
    assert store.delete_corpus(t, "docs") == 1 and [c.name for c in store.list_corpora(t)] == ["default"]
    with pytest.raises(ValueError, match="document 1"):
        store.add_corpus_documents(t, [[1], [-1]])

    states = np.random.default_rng(1).standard_normal((6, 16)).astype(np.float16)
    store.put_hidden_states(t, "req-1", np.arange(10, 16), states)
    positions, back = store.get_hidden_states(t, "req-1")
    assert positions.tolist() == list(range(10, 16)) and back.dtype == np.float16 and np.array_equal(back, states)
    assert store.get_hidden_states(t, "other") is None
    with pytest.raises(ValueError, match="shape"):
        store.put_hidden_states(t, "bad", [1, 2], np.zeros((3, 4)))
    with pytest.raises(TypeError, match="floating"):
        store.put_hidden_states(t, "bad", [1], np.zeros((1, 4), dtype=np.int32))
    assert store.delete_hidden_states(t, "req-1") and store.get_hidden_states(t, "req-1") is None
    assert store.count_records(t) == 2  # snapshot "default" and one corpus part
    store.close()


def test_restart_recovers_everything(make_config, master_env) -> None:
    config = make_config()
    store = open_store(config, env=master_env)
    t = store.create_tenant("acme")
    written = [_traj(i) for i in range(25)]
    store.append_trajectories(t.id, written)
    store.put_snapshot(t.id, b"index bytes", cursor="x")
    store.add_corpus_documents(t.id, [[1, 2, 3]])
    key = store.create_api_key(t.id)
    store.close()
    again = open_store(config, env=master_env)
    assert again.authenticate(key.secret) == t.id
    assert again.get_tenant(t.id) == t
    assert [r.trajectory for r in again.iter_trajectories(t.id)] == written
    assert again.get_snapshot(t.id).data == b"index bytes"
    assert [d.tolist() for d in again.iter_corpus(t.id)] == [[1, 2, 3]]
    again.close()


def test_tenants_never_see_each_other(store) -> None:
    a, b = store.create_tenant("a").id, store.create_tenant("b").id
    store.append_trajectory(a, "shared-session-name", [1, 2, 3], "a's secret")
    store.append_trajectory(b, "shared-session-name", [4, 5, 6], "b's text")
    store.put_snapshot(a, b"a-index")
    store.add_corpus_documents(a, [[11, 12]])
    assert [r.trajectory.text for r in store.iter_trajectories(b)] == ["b's text"]
    assert [r.trajectory.text for r in store.iter_trajectories(b, session_id="shared-session-name")] == ["b's text"]
    assert store.get_snapshot(b) is None and store.list_corpora(b) == []
    assert store.count_records(b) == 1
