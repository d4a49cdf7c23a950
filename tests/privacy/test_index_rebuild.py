"""An index rebuilt from the encrypted store (or loaded from a sealed snapshot plus the trajectories after
it) drafts exactly as the index built live; a tenant's index holds only its own history."""

from __future__ import annotations

import numpy as np

from privacy import open_store
from suffix_index import SuffixIndex


def _agent_like(seed: int, n: int, base: int) -> list[np.ndarray]:
    """Trajectories that repeat motifs (tool-call shapes) with variations, as agents do."""
    rng = np.random.default_rng(seed)
    motifs = [rng.integers(base, base + 400, size=int(rng.integers(5, 30))) for _ in range(12)]
    out = []
    for _ in range(n):
        parts = [motifs[int(i)] for i in rng.integers(0, len(motifs), size=int(rng.integers(3, 10)))]
        parts.insert(int(rng.integers(0, len(parts))), rng.integers(base, base + 400, size=4))
        out.append(np.concatenate(parts).astype(np.int32))
    return out


def _drafts(index, contexts) -> list[tuple]:
    out = []
    for ctx in contexts:
        for tree in (False, True):
            d = index.speculate(ctx, 16, max_spec_factor=2.0, min_token_prob=0.05, use_tree=tree)
            out.append((d.token_ids.tolist(), d.parents.tolist(), d.probs.tolist(), d.score, d.match_len))
        e = index.speculate_exact(ctx, 16)
        out.append((e.token_ids.tolist(), e.parents.tolist(), e.match_len))
    return out


def _contexts(trajs, rng) -> list[np.ndarray]:
    picks = [trajs[int(i)] for i in rng.integers(0, len(trajs), size=40)]
    return [t[: int(rng.integers(1, len(t)))] for t in picks]


def test_rebuilt_and_snapshot_indexes_draft_exactly_as_before(make_config, master_env) -> None:
    config = make_config(chunk_bytes=4096)
    store = open_store(config, env=master_env)
    tenant = store.create_tenant("acme").id
    trajs = _agent_like(0, 60, 1000)
    live = SuffixIndex(max_depth=32)
    refs = []
    for i, ids in enumerate(trajs[:40]):
        refs.append(store.append_trajectory(tenant, f"s{i % 5}", ids, ""))
        live.add(i, ids)
    store.put_snapshot(tenant, live.serialize(), cursor=refs[-1].cursor)
    for i, ids in enumerate(trajs[40:], start=40):
        store.append_trajectory(tenant, f"s{i % 5}", ids, "")
        live.add(i, ids)
    store.close()

    store = open_store(config, env=master_env)  # a restart: only the sealed store remains
    rebuilt = SuffixIndex(max_depth=32)
    for i, rec in enumerate(store.iter_trajectories(tenant)):
        rebuilt.add(i, rec.trajectory.token_ids)
    snap = store.get_snapshot(tenant)
    warm = SuffixIndex.deserialize(snap.data)
    for i, rec in enumerate(store.iter_trajectories(tenant, after=snap.cursor), start=40):
        warm.add(i, rec.trajectory.token_ids)
    store.close()
    for index in (rebuilt, warm):
        index.check_integrity()
        assert index.num_tokens == live.num_tokens
    contexts = _contexts(trajs, np.random.default_rng(1))
    expected = _drafts(live, contexts)
    assert sum(len(d[0]) for d in expected) > 100  # the drafts are not trivially empty
    assert _drafts(rebuilt, contexts) == expected
    assert _drafts(warm, contexts) == expected


def test_a_tenants_index_holds_only_its_history(store) -> None:
    a, b = store.create_tenant("a").id, store.create_tenant("b").id
    a_trajs, b_trajs = _agent_like(2, 20, 10_000), _agent_like(3, 20, 20_000)  # disjoint vocabularies
    for ids in a_trajs:
        store.append_trajectory(a, "s", ids)
    for ids in b_trajs:
        store.append_trajectory(b, "s", ids)
    index_b = SuffixIndex(max_depth=32)
    for i, rec in enumerate(store.iter_trajectories(b)):
        index_b.add(i, rec.trajectory.token_ids)
    assert index_b.num_tokens == sum(len(t) for t in b_trajs)
    for ctx in _contexts(a_trajs, np.random.default_rng(4)):
        assert len(index_b.speculate(ctx, 16, use_tree=True)) == 0
    drafted = [index_b.speculate(ctx, 16).token_ids for ctx in _contexts(b_trajs, np.random.default_rng(5))]
    assert all(((d >= 20_000) & (d < 20_400)).all() for d in drafted) and any(len(d) for d in drafted)
