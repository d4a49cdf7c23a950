"""Hidden-state keyed reuse: finds continuations exact keys miss, stays within its tenant and its
memory bound, and persists encrypted through the history store."""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest

from neural_drafters.reuse import HiddenStateMemory, Projection, ReuseSettings
from privacy import StoreConfig, open_store
from privacy.tenants import TenantId
from reprise.server.hidden_store import HiddenStatePersistence, segment_key

D = 32


def states(rng, n: int) -> np.ndarray:
    return rng.standard_normal((n, D)).astype(np.float32)


def memory(**settings) -> HiddenStateMemory:
    return HiddenStateMemory(D, ReuseSettings(dim=16, **settings))


def finished_request(mem, tenant: str, tokens: list[int], hidden: np.ndarray) -> None:
    req = mem.start(tenant, tokens)
    req.observe_hidden(hidden[: len(tokens) - 1])
    req.finish(record=True)


def test_random_projection_keeps_cosines_roughly() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 576)).astype(np.float32)
    y = x + 0.5 * rng.standard_normal((200, 576)).astype(np.float32)
    proj = Projection.random(576, 64, seed=1)
    px, py = proj(x).astype(np.float32), proj(y).astype(np.float32)
    true = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    assert np.abs((px * py).sum(1) - true).mean() < 0.08
    assert np.allclose(np.linalg.norm(px, axis=1), 1.0, atol=2e-3)


def test_pca_projection_needs_samples_and_keeps_the_main_directions() -> None:
    rng = np.random.default_rng(1)
    basis = rng.standard_normal((3, D))
    x = rng.standard_normal((300, 3)) @ basis + 0.01 * rng.standard_normal((300, D))
    proj = Projection.pca(x, 3)
    assert proj.dim == 3 and proj.hidden_size == D
    with pytest.raises(ValueError, match="at least 2 samples"):
        Projection.pca(x[:1], 3)
    with pytest.raises(ValueError, match="PCA projection must be fitted"):
        HiddenStateMemory(D, ReuseSettings(projection="pca"))


def test_state_match_copies_what_followed_when_tokens_differ() -> None:
    rng = np.random.default_rng(2)
    mem = memory(copy_short=4, copy_long=6)
    past = [5, 6, 7, 900, 10, 11, 12, 13, 14, 15, 16]  # 900: a fresh value, then the usual continuation
    hidden = states(rng, len(past))
    finished_request(mem, "acme", past, hidden)
    now = [1, 2, 901, 10]  # a different fresh value: no exact key reaches 11, 12, ...
    req = mem.start("acme", now)
    query = hidden[:3].copy()
    query[2] = hidden[3] + 0.05 * rng.standard_normal(D)  # the state after the fresh value is alike
    req.observe_hidden(query)
    draft = req.propose(32)
    assert draft.token_ids.tolist() == [11, 12, 13, 14, 15, 16] and draft.similarity > 0.9
    assert len(req.propose(3)) == 3  # the budget caps the copy
    other = mem.start("acme", [1, 2, 901, 99])  # same state, but the last token is not what followed it
    other.observe_hidden(query)
    assert len(other.propose(32)) == 0


def test_thresholds_and_own_request_positions() -> None:
    rng = np.random.default_rng(3)
    mem = memory(fire_threshold=0.95, long_threshold=0.99, copy_short=2, copy_long=5)
    tokens = [3, 4, 5, 6, 7, 3, 4]
    hidden = states(rng, len(tokens))
    hidden[5] = hidden[0] + 0.1 * rng.standard_normal(D)  # this request saw position 0's state before
    req = mem.start("t", tokens)
    req.observe_hidden(hidden[:6])
    draft = req.propose(8)  # key: state h_5 ~ h_0 and last token 4 == token after position 0
    assert draft.token_ids.tolist() in ([5, 6], [5, 6, 7, 3, 4])
    far = mem.start("t", tokens)
    far.observe_hidden(states(rng, 6))
    assert len(far.propose(8)) == 0  # nothing similar enough


def test_tenants_do_not_share_positions() -> None:
    rng = np.random.default_rng(4)
    mem = memory()
    tokens = [1, 2, 3, 4, 5, 6]
    hidden = states(rng, len(tokens))
    finished_request(mem, "alpha", tokens, hidden)
    for tenant, expected in (("alpha", 3), ("beta", 0)):
        req = mem.start(tenant, [9, 2])
        req.observe_hidden(hidden[:1])
        assert len(req.propose(3)) == expected, tenant


def test_memory_is_bounded_and_drops_the_oldest_segments() -> None:
    rng = np.random.default_rng(5)
    mem = memory(max_positions=40)
    segments = []
    for i in range(10):
        tokens = (np.arange(12) + 100 * i).tolist()
        hidden = states(rng, 12)
        finished_request(mem, "t", tokens, hidden)
        segments.append((tokens, hidden))
    tm = mem.tenant("t")
    assert tm.num_rows == 40 and len(tm.segments) <= 5
    first_tokens, first_hidden = segments[0]
    req = mem.start("t", first_tokens[:2])
    req.observe_hidden(first_hidden[:1])
    assert len(req.propose(5)) == 0  # evicted
    last_tokens, last_hidden = segments[-1]
    req = mem.start("t", last_tokens[:2])
    req.observe_hidden(last_hidden[:1])
    assert req.propose(3).token_ids.tolist() == last_tokens[2:5]
    before = tm.nbytes()
    finished_request(mem, "t", list(range(5000, 5012)), states(rng, 12))
    assert tm.nbytes() <= before + 200  # bounded: rows are reused, old segments dropped


def test_settings_validate() -> None:
    with pytest.raises(ValueError, match="fire_threshold <= long_threshold"):
        ReuseSettings(fire_threshold=0.9, long_threshold=0.8)
    with pytest.raises(ValueError, match="copy_short <= copy_long"):
        ReuseSettings(copy_short=10, copy_long=5)
    with pytest.raises(ValueError, match="unknown projection 'umap'"):
        ReuseSettings(projection="umap")


def test_vectors_persist_encrypted_and_scoped(tmp_path) -> None:
    env = {"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}
    store = open_store(StoreConfig(data_dir=tmp_path / "data"), env=env)
    try:
        alpha = store.create_tenant("alpha").id.value  # the engine's tenant strings are tenant ids
        beta = store.create_tenant("beta").id.value
        rng = np.random.default_rng(6)
        mem = memory()
        saver = HiddenStatePersistence(store)
        tokens = [7, 8, 9, 10, 11, 12, 13]
        hidden = states(rng, len(tokens))
        req = mem.start(alpha, tokens)
        req.observe_hidden(hidden[:6])
        segment = req.finish(record=True)
        store.append_trajectory(TenantId(alpha), "s1", tokens)  # what the history writer stores
        key = saver.save(alpha, "s1", segment)
        assert key == segment_key("s1", tokens)
        raw = (tmp_path / "data" / "history.db").read_bytes()
        assert segment.vectors.tobytes()[:64] not in raw  # sealed, not plain fp16
        restored = memory()
        assert saver.restore(alpha, restored) == 1
        assert saver.restore(beta, restored) == 0
        probe = restored.start(alpha, [1, 8])
        probe.observe_hidden(hidden[:1])
        assert probe.propose(4).token_ids.tolist() == [9, 10, 11, 12]
        probe_other = restored.start(beta, [1, 8])
        probe_other.observe_hidden(hidden[:1])
        assert len(probe_other.propose(4)) == 0
    finally:
        store.close()
