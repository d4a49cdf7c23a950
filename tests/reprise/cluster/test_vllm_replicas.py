"""Replicas on vLLM (``--model-engine vllm --cluster-enabled``): two real `reprise serve` processes, each
with its own vLLM engine and Reprise's proposer in its worker, on one private Redis. The same scenario as
the own engine's replicas (test_replicas.py): a turn decoded on one replica is drafted from on the other,
and a deletion on one reaches the other's worker. Then a replica restarts and its first request of the
tenant drafts from the tenant's whole history."""

from __future__ import annotations

import pytest
import redis
from test_replicas import PROMPT, _stats, scenario
from testkit.cluster import start_replicas

from grpc_api.client import AdminClient, RepriseClient
from reprise.backends.vllm.versions import VllmUnavailableError, require_vllm

try:
    require_vllm()
    _SKIP = ""
except VllmUnavailableError as exc:
    _SKIP = str(exc)

pytestmark = [pytest.mark.redis, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "vLLM installed")]

VLLM = {"engine": "vllm", "model-dtype": "float32", "model-num-slots": "4"}
ENV = {"REPRISE_MODEL_COMPILE": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}  # a sooner start, a smaller KV cache


def _replicas(n: int, d) -> list:
    return start_replicas(n, d.workdir, d.redis.url, {**d.env, **ENV}, tiny=False, **VLLM)


def test_vllm_replicas_share_each_tenants_history_and_a_restarted_one_drafts_from_it(deployment) -> None:
    d = deployment
    with d.store() as store:  # a third tenant for the restart (the scenario's two start without history)
        t = store.create_tenant("initech")
        initech, initech_key = t.id.value, store.create_api_key(t.id).secret
    a, b = _replicas(2, d)
    try:
        with RepriseClient(a.target, initech_key) as ca:  # a turn of initech on A, before B restarts
            first = ca.generate(tokens=PROMPT, max_new_tokens=64, ignore_eos=True, session_id="i-1")
        b.stop()
        (b,) = _replicas(1, d)  # B restarted: an empty worker
        with RepriseClient(b.target, initech_key) as cb:  # its first request of initech
            again = cb.generate(tokens=PROMPT, max_new_tokens=64, ignore_eos=True, session_id="i-2")
        assert again.token_ids == first.token_ids
        s = _stats(b.target, d.admin_key, initech)
        assert s.num_accepted_tokens >= 48, "the restarted replica's first request did not draft from history"
        scenario(a, b, d.admin_key, d.tenants, [redis.Redis(port=d.redis.port)])
        with AdminClient(a.target, d.admin_key) as admin:  # the admin plane reads the worker's index
            assert initech in {s.tenant_id for s in admin.index_stats()}
    finally:
        for r in (a, b):
            r.stop()
