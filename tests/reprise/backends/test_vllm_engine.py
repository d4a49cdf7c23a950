"""The ``vllm`` backend on the real vLLM engine and the real SmolLM2-135M-Instruct.

One engine for the whole module (vLLM's start-up is the cost: ~20-40 s here with ``enforce_eager``),
Reprise's proposer in its worker; every test uses its own tenants, so they share the engine without
seeing each other's history. Skipped, saying why, where vLLM is not installed (``make install-vllm``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reprise.backends.vllm.versions import VllmUnavailableError, require_vllm
from serving.admission import CancelEvent
from serving.records import Finished, PromptInput, Request, Tokens
from serving.render import PromptRenderer

try:
    require_vllm()
    _SKIP = ""
except VllmUnavailableError as exc:
    _SKIP = str(exc)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "vLLM installed")]

# A system prompt long enough to fill prefix-cache blocks; the tasks ask for text the prompt does not hold.
SYSTEM = "You are a careful assistant for an airline. " * 40
TASKS = ("Write a short poem about the sea at night.", "Describe a quiet morning in a small mountain village.",
         "Explain in a few sentences why the sky looks blue.")


@pytest.fixture(scope="module")
def vllm_engine() -> Iterator[object]:
    from testkit.vllm_faults import FAULTY_EXTENSION

    from reprise.backends.vllm.engine import VllmEngine, VllmSettings
    from verifier.models import ensure_default_model

    engine = VllmEngine(VllmSettings(
        model=str(ensure_default_model()), dtype="float32", max_model_len=2048, max_num_seqs=8,
        num_speculative_tokens=16, enforce_eager=True, kv_cache_gib=1.0, worker_extension=FAULTY_EXTENSION))
    yield engine
    engine.close()


class Stack:
    """A store, the history writer and the backend over the shared engine: what the service wires."""

    def __init__(self, engine: object, home: Path, master_env: dict[str, str], drafter: str = "") -> None:
        from privacy import open_store
        from privacy.config import StoreConfig
        from reprise.config import ModelConfig, ServiceConfig
        from reprise.server.history_writer import HistoryWriter
        from reprise.server.index_budget import IndexResidency
        from reprise.server.indexes import TenantIndexes
        from reprise.server.metering import TenantAccounting
        from reprise.server.vllm import attach_tenants, vllm_backend

        self.config = ServiceConfig(home=home, model=ModelConfig(drafter=drafter))
        self.store = open_store(StoreConfig(data_dir=home), env=master_env)
        self.history = HistoryWriter(self.store)
        self.accounting = TenantAccounting()
        tenants, tokenizer = attach_tenants(engine, self.config, self.store)
        self.indexes = TenantIndexes(self.store, tenants, self.accounting)
        self.indexes.load_all()
        self.backend = vllm_backend(engine, tokenizer, self.config, self.accounting, None, self.history.put,
                                    self.indexes.record, owns_engine=False)
        self.residency = IndexResidency(self.indexes)

    def tenant(self) -> str:
        return self.store.create_tenant(f"t-{uuid.uuid4().hex[:8]}").id.value

    def generate(self, tenant: str, task: str, *, session: str = "", speculate: bool = True,
                 max_new_tokens: int = 48, on_tokens: Callable[[int], None] | None = None,
                 **params: Any) -> list[int]:
        """The task's output; ``params``: more of ``GenerateParams``' fields, ``on_tokens`` as ``decode``'s."""
        prompt = tuple(PromptRenderer(self.backend.tokenizer, self.backend.model_info()).render(
            PromptInput(messages=_messages(task))))
        request = Request.of_tokens(prompt, tenant=tenant, request_id=uuid.uuid4().hex,
                                    session_id=session or uuid.uuid4().hex, max_new_tokens=max_new_tokens,
                                    speculate=speculate, **params)

        async def held() -> tuple[list[int], Finished]:
            async with self.residency.hold(tenant, speculate):  # as the serving core holds it
                return await decode(self.backend, request, on_tokens)

        out, end = asyncio.run(held())
        assert end.usage.completion_tokens == len(out)
        return out

    def stats(self, tenant: str) -> object:
        return self.indexes.stats(tenant)

    def close(self) -> None:
        self.backend.close_now()  # the engine is the module's: it stays up
        self.history.close()
        self.store.close()


async def decode(backend: object, request: Request, on_tokens: Callable[[int], None] | None = None
                 ) -> tuple[list[int], Finished]:
    """A request through the backend's async stream: its tokens and its end (``on_tokens``: called with
    the number of tokens so far as they arrive)."""
    out: list[int] = []
    end = None
    async for event in backend.generate(request, CancelEvent()):  # type: ignore[attr-defined]
        if isinstance(event, Tokens):
            out.extend(event.token_ids)
            if on_tokens is not None:
                on_tokens(len(out))
        else:
            end = event
    assert isinstance(end, Finished)
    return out, end


def _messages(task: str) -> tuple:
    from serving.records import ChatMessage

    return (ChatMessage("system", SYSTEM), ChatMessage("user", task))


@pytest.fixture
def master_env() -> dict[str, str]:
    return {"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}


@pytest.fixture
def stack(vllm_engine, tmp_path, master_env) -> Iterator[Stack]:
    s = Stack(vllm_engine, tmp_path / "home", master_env)
    yield s
    s.close()


def test_greedy_outputs_with_reprise_drafting_equal_plain_decoding(stack):
    tenant = stack.tenant()
    plain = [stack.generate(tenant, t, speculate=False) for t in TASKS]
    drafted = [stack.generate(tenant, t) for t in TASKS]
    again = [stack.generate(tenant, t) for t in TASKS]  # now drafted from the tenant's history
    assert drafted == plain
    assert again == plain
    stats = stack.stats(tenant)
    assert stats.num_accepted_tokens > 0, "the repeated tasks were not drafted at all"
    # The worker timed its steady steps: the tenant's share of them, and the plain-step estimate of its tokens.
    assert stats.savings.decode_seconds > 0 and stats.savings.num_tokens > 0 and stats.savings.speedup is not None

    # Eight at once (continuous batching, drafts of several tenants in one step): still identical.
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = stack.generate(tenant, TASKS[i % len(TASKS)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert [results[i] for i in range(8)] == [plain[i % len(TASKS)] for i in range(8)]


def test_a_tenant_never_drafts_from_another_tenants_history(stack):
    a, b = stack.tenant(), stack.tenant()
    task = TASKS[0]
    first = stack.generate(a, task)
    stack.history.flush()
    # A's repeat (a new session: nothing of the first request's context carries over) drafts from A's history.
    assert stack.generate(a, task) == first
    sa = stack.stats(a)
    assert sa.drafter_steps.get("reprise:history", 0) > 0
    assert sa.num_accepted_tokens >= len(first) // 2
    # B asks the same: B has no history, so none of its drafts comes from one, and few tokens are accepted.
    assert stack.generate(b, task) == first
    sb = stack.stats(b)
    assert sb.num_steps > 0
    assert "reprise:history" not in sb.drafter_steps
    assert sb.num_accepted_tokens < sa.num_accepted_tokens // 2
    assert stack.stats(a).index_sequences == 2 and sb.index_sequences == 1


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_a_failing_or_stalling_proposer_degrades_to_no_draft_with_one_warning(stack, vllm_engine, mode):
    tenant = stack.tenant()
    expected = stack.generate(tenant, TASKS[1], speculate=False)
    before = stack.backend.health()
    vllm_engine.rpc("reprise_test_fault", mode, 0.5)
    try:
        out = stack.generate(tenant, TASKS[1])
    finally:
        vllm_engine.rpc("reprise_test_fault", "")
    after = stack.backend.health()
    assert out == expected
    assert after["warnings"] - before["warnings"] == 1
    if mode == "raise":
        assert after["failed_steps"] - before["failed_steps"] >= 10
    else:
        assert after["stalled_steps"] - before["stalled_steps"] >= 1
    # The engine goes on serving, and drafting comes back once the fault is gone.
    assert stack.generate(tenant, TASKS[1]) == expected


def test_prefix_cache_salt_is_per_tenant_and_a_tenant_hits_its_own_cache(stack):
    a, b = stack.tenant(), stack.tenant()
    assert stack.backend.cache_salt(a) != stack.backend.cache_salt(b)
    assert stack.backend.cache_salt(a) == stack.backend.cache_salt(a)
    assert a not in stack.backend.cache_salt(a)
    stack.generate(a, TASKS[2], max_new_tokens=4)
    assert stack.backend.prefix_cached_tokens[a] == 0
    stack.generate(a, TASKS[2], max_new_tokens=4)
    hit = stack.backend.prefix_cached_tokens[a]
    assert hit >= 256, "a tenant's repeated prompt must hit its own prefix cache"
    stack.generate(b, TASKS[2], max_new_tokens=4)
    assert stack.backend.prefix_cached_tokens[b] == 0, "another tenant reused cached blocks"


def test_history_through_vllm_lands_in_the_store_and_survives_a_restart(vllm_engine, tmp_path, master_env):
    from privacy.tenants import TenantId

    home = tmp_path / "home"
    first = Stack(vllm_engine, home, master_env)
    tenant = first.tenant()
    output = first.generate(tenant, TASKS[2], session="s-1")
    first.history.flush()
    stored = list(first.store.iter_trajectories(TenantId(tenant)))
    assert len(stored) == 1
    ids = np.asarray(stored[0].trajectory.token_ids)
    assert ids[stored[0].trajectory.num_prompt_tokens:].tolist() == output
    first.close()
    vllm_engine.rpc("reprise_evict", tenant)  # what a fresh worker holds of the tenant: nothing

    # The restart: a new store handle and backend; start-up streams the stored history into the worker.
    second = Stack(vllm_engine, home, master_env)
    try:
        assert second.stats(tenant).index_sequences == 1
        assert second.generate(tenant, TASKS[2], session="s-2") == output
        assert second.stats(tenant).drafter_steps.get("reprise:history", 0) > 0
    finally:
        second.close()


def test_the_neural_fallback_drafts_where_retrieval_has_nothing_and_outputs_stay_the_targets(
        vllm_engine, tmp_path, master_env, monkeypatch):
    """``model.drafter = "hybrid"``: a Medusa checkpoint at the drafter checkpoint's place drafts the
    steps retrieval has nothing for (a tenant without history, text its prompt does not hold). An
    untrained Medusa block is the identity, so this head guesses with the target's own next-token
    confidence: a sure guess, often wrong, verified like any draft. Greedy outputs stay the target's."""
    from neural_drafters.checkpoint import save_checkpoint
    from neural_drafters.config import HeadConfig
    from neural_drafters.heads import build_head

    folder = vllm_engine.settings.model
    cfg = json.loads((Path(folder) / "config.json").read_text())
    head = build_head(HeadConfig(kind="medusa", hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                                 num_key_value_heads=cfg["num_key_value_heads"],
                                 head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
                                 intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                                 draft_vocab_size=cfg["vocab_size"], num_heads=2, target=folder))
    save_checkpoint(tmp_path / "head", head, step=1)
    monkeypatch.setenv("REPRISE_DRAFTER_CHECKPOINT", str(tmp_path / "head"))
    plain = Stack(vllm_engine, tmp_path / "plain", master_env)
    try:
        expected = [plain.generate(plain.tenant(), t, speculate=False) for t in TASKS[:2]]
    finally:
        plain.close()
    hybrid = Stack(vllm_engine, tmp_path / "home", master_env, drafter="hybrid")
    try:
        before = hybrid.backend.health()
        tenant = hybrid.tenant()
        assert [hybrid.generate(tenant, t) for t in TASKS[:2]] == expected
        after = hybrid.backend.health()
        assert after["fallback_steps"] - before.get("fallback_steps", 0) > 0
        stats = hybrid.stats(tenant)
        assert stats.drafter_steps.get("neural", 0) > 0  # some of its chains were verified
    finally:
        hybrid.close()
    again = Stack(vllm_engine, tmp_path / "again", master_env)  # the default drafter: no fallback
    try:
        before = again.backend.health()["fallback_steps"]
        again.generate(again.tenant(), TASKS[0], max_new_tokens=16)
        assert again.backend.health()["fallback_steps"] == before
    finally:
        again.close()


@pytest.mark.redis
def test_a_replica_on_vllm_drafts_from_a_turn_another_replica_wrote_and_follows_a_deletion(
        vllm_engine, tmp_path, master_env):
    """Replica A: the cluster parts over this module's engine, as ``reprise serve --engine vllm
    --cluster-enabled`` wires them (``Service._vllm``); replica B: another replica of the same store
    (the real Redis, a key prefix of this test's own) that appends a turn. B's turn reaches A's worker
    through the tenant's stream and the change feed, and A drafts from it; B's deletion of the tenant
    drops it from A's worker and A refuses it."""
    from testkit.cluster import wait_for

    from privacy import open_store
    from privacy.config import StoreConfig
    from privacy.tenants import TenantId
    from reprise.cluster.node import ClusterNode
    from reprise.config import ClusterConfig, ServiceConfig
    from reprise.server.metering import TenantAccounting
    from reprise.server.vllm import attach_tenants, vllm_backend
    from retrieval.proposer import RepriseProposer
    from serving import errors

    prefix = f"test-vllm-replica-{uuid.uuid4().hex[:8]}"
    stores = [open_store(StoreConfig(backend="redis", redis_key_prefix=prefix, data_dir=tmp_path / name),
                         env=master_env) for name in ("a", "b")]
    cluster = ClusterConfig(enabled=True, replica_id="a", resync_interval_s=1.0)
    node_a = ClusterNode(cluster, stores[0], None)
    tenants, tokenizer = attach_tenants(vllm_engine, ServiceConfig(home=tmp_path), stores[0])
    node_a.set_proposer(tenants)
    accounting = TenantAccounting()
    indexes = node_a.indexes(accounting)
    backend = vllm_backend(vllm_engine, tokenizer, ServiceConfig(home=tmp_path), accounting, None,
                           node_a.writer.put, indexes.record, index_turns=False, owns_engine=False)
    residency = node_a.residency()
    node_b = ClusterNode(ClusterConfig(enabled=True, replica_id="b", resync_interval_s=1.0), stores[1],
                         RepriseProposer())
    node_a.start()
    node_b.start()

    def generate(tenant: str, *, speculate: bool, record: bool = True) -> list[int]:
        prompt = tuple(PromptRenderer(tokenizer, backend.model_info()).render(PromptInput(messages=_messages(TASKS[0]))))
        request = Request.of_tokens(prompt, tenant=tenant, request_id=uuid.uuid4().hex, session_id=uuid.uuid4().hex,
                                    max_new_tokens=48, speculate=speculate, record=record)

        async def run() -> list[int]:
            async with residency.hold(tenant, speculate):
                return (await decode(backend, request))[0]

        return asyncio.run(run())

    try:
        tenant = stores[0].create_tenant("acme").id.value
        expected = generate(tenant, speculate=False, record=False)
        assert node_a.replica.ensure(tenant, 10.0)  # A holds the tenant (a drafting request loads it): empty
        assert indexes.stats(tenant).index_sequences == 0
        node_b.indexes(TenantAccounting()).record(tenant, "on-b", expected)  # B's AppendTrajectory
        delay = wait_for(lambda: indexes.stats(tenant).index_sequences == 1, timeout=10)
        assert delay < 2.0  # announced on the feed: not the resync's second
        assert generate(tenant, speculate=True) == expected
        s = indexes.stats(tenant)
        assert s.drafter_steps.get("reprise:history", 0) > 0 and s.num_accepted_tokens >= len(expected) // 2
        wait_for(lambda: indexes.stats(tenant).index_sequences == 2, timeout=10)  # A's own turn, via the stream
        stores[1].delete_tenant(TenantId(tenant))  # deleted through B
        wait_for(lambda: tenant in node_a.replica.deleted, timeout=10)
        with pytest.raises(errors.Unauthenticated):
            generate(tenant, speculate=True)
        with pytest.raises(KeyError):
            tenants.record(tenant, "late", [1, 2], [3, 4])  # the worker refuses the deleted tenant
    finally:
        node_b.stop()
        node_a.stop()
        backend.close_now()
        node_a.writer.close()
        for store in stores:
            store.close()


def test_a_waiting_tenant_takes_a_slot_from_the_tenant_holding_all_and_outputs_stay_the_same(stack, vllm_engine):
    """Tenant A fills every slot (8) with long requests; tenant B's short one starts while none of A's
    has ended (vLLM's own scheduler would keep it waiting until one had): the fair-share scheduler
    preempted one of A's, and A's greedy outputs are what they are without B (scheduler.py). (Greedy
    only: in this CPU build a seeded sampled request's first token, and the greedy outputs of a batch
    that also holds sampled requests, varied between identical runs, preemption or not.)"""
    num_tokens = 160

    def flood(with_b: bool) -> tuple[list[list[int]], list[int]]:
        a, b = stack.tenant(), stack.tenant()  # fresh tenants: both runs draft from the same (no) history
        outs: dict[int, list[int]] = {}
        progress = [0] * 8
        started = [threading.Event() for _ in range(8)]

        def seen(i: int, n: int) -> None:
            progress[i] = n
            started[i].set()

        def run(i: int) -> None:
            outs[i] = stack.generate(a, TASKS[i % len(TASKS)], max_new_tokens=num_tokens, ignore_eos=True,
                                     on_tokens=lambda n: seen(i, n))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        assert all(e.wait(300) for e in started)
        at_b: list[int] = []  # A's tokens when B's first came
        if with_b:
            stack.generate(b, TASKS[0], max_new_tokens=8, on_tokens=lambda n: at_b or at_b.extend(progress))
        for th in threads:
            th.join(600)
        return [outs[i] for i in range(8)], at_b

    alone, _ = flood(with_b=False)
    shared, at_b = flood(with_b=True)
    assert max(at_b) < num_tokens, f"B waited for one of A's requests to end ({at_b} of {num_tokens} tokens)"
    assert shared == alone
