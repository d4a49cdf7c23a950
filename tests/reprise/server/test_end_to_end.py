"""The whole service over real gRPC on loopback: encrypted store, decode pipeline, tiny random Llama.

Exactness is checked against the decode pipeline run directly on an identical model (and against
transformers' greedy decoding); the real SmolLM2 runs in the slow tests.
"""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from testkit.service import TINY_EOS, byte_tokenizer, start_service, tiny_llama

from grpc_api.client import AdminClient, RepriseClient, RepriseError
from privacy import TenantId
from reprise.engine.engine import Engine
from reprise.server.hidden_store import segment_key
from reprise.server.tenant_config import save_drafting_config
from retrieval.config import DraftingConfig
from retrieval.registry import make_proposer, proposer_names
from serving.records import Request
from verifier.runner import ModelRunner
from verifier.testing import hf_greedy


@pytest.fixture(scope="module")
def reference():
    """The pipeline alone, on a model identical to the service's (same seed)."""
    model = tiny_llama()
    engine = Engine(ModelRunner(model, num_slots=1, max_len=1000), make_proposer("prompt_lookup"), byte_tokenizer())

    def run(prompt_ids, max_new_tokens, **params):
        handle = engine.submit(Request.of_tokens(prompt_ids, max_new_tokens=max_new_tokens, **params))
        engine.run_until_idle()
        return handle.wait()

    run.model = model
    return run


def tenant_key(r, name: str = "acme") -> tuple[str, str]:
    with AdminClient(r.target, r.admin_key) as admin:
        tenant, key = admin.create_tenant(name)
    return tenant.tenant_id, key


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_streamed_output_equals_the_pipeline(running, reference) -> None:
    _, key = tenant_key(running)
    tok = byte_tokenizer()
    with RepriseClient(running.target, key) as client:
        for i, text in enumerate(["The quick brown fox", "def f(x):\n    return", "abcabcabcabc"]):
            prompt = tok.encode(text, add_special_tokens=False)
            stream = client.generate_stream(text=text, max_new_tokens=40, session_id=f"s{i}")
            chunks = list(stream)
            expected = reference(prompt, 40)
            assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
            assert "".join(c.text for c in chunks) == expected.text == stream.completion.text
            assert all(len(c.token_ids) == 1 for c in chunks if c.token_ids)  # fixed one-token quanta
            assert list(expected.token_ids) == hf_greedy(reference.model, prompt, len(expected.token_ids), eos=True)
            unary = client.generate(tokens=prompt, max_new_tokens=40)
            assert unary.token_ids == list(expected.token_ids) and unary.text == expected.text
            assert unary.prompt_tokens == len(prompt) and unary.completion_tokens == len(expected.token_ids)
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        got = client.generate(messages=chat, max_new_tokens=24)
        assert got.token_ids == list(reference(ids, 24).token_ids)


def test_sampling_and_stop_conditions(running, reference) -> None:
    _, key = tenant_key(running)
    prompt = list(range(40, 60))
    with RepriseClient(running.target, key) as client:
        # A seed reproduces a sampled output when nothing is drafted: drafts change how random numbers
        # are consumed (the distribution stays exact), and the second request drafts from the first.
        a = client.generate(tokens=prompt, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=1234,
                            speculation=False)
        b = client.generate(tokens=prompt, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=1234,
                            speculation=False)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30
        c = client.generate(tokens=prompt, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=1234)
        assert len(c.token_ids) == 30 and all(0 <= t < 258 for t in c.token_ids)
        greedy = reference(prompt, 30)
        stop_tok = greedy.token_ids[5]
        c = client.generate(tokens=prompt, max_new_tokens=30, stop_token_ids=[stop_tok])
        assert c.finish_reason == "stop" and c.matched_stop == stop_tok
        assert c.token_ids == list(greedy.token_ids[:greedy.token_ids.index(stop_tok) + 1])
        if greedy.text[8:10]:
            stop = greedy.text[8:10]
            d = client.generate(tokens=prompt, max_new_tokens=30, stop=[stop])
            assert d.finish_reason == "stop" and d.matched_stop == stop and d.text == greedy.text[: greedy.text.index(stop)]
        e = client.generate(tokens=prompt, max_new_tokens=7)
        assert e.finish_reason in ("length", "eos") and len(e.token_ids) <= 7
        off = client.generate(tokens=prompt, max_new_tokens=30, speculation=False)
        assert off.token_ids == list(greedy.token_ids)  # same output, one token per step


def test_eos_is_reported(running) -> None:
    _, key = tenant_key(running)
    with RepriseClient(running.target, key) as client:
        # Force EOS: it is the model's EOS id and a stop id at once; either way the request ends there.
        got = client.generate(tokens=[5, 6, 7], max_new_tokens=200, min_new_tokens=0)
        assert got.finish_reason in ("eos", "length")
        if got.finish_reason == "eos":
            assert got.matched_stop == TINY_EOS


def test_history_is_stored_and_do_not_record_is_honoured(running) -> None:
    tid, key = tenant_key(running)
    with RepriseClient(running.target, key) as client:
        client.generate(tokens=[10, 11, 12], max_new_tokens=5, session_id="kept")
        client.generate(tokens=[10, 11, 13], max_new_tokens=5, session_id="secret", do_not_record=True)
        assert client.append_trajectory("kept", text="tool says 42") == len("tool says 42")
    store = running.service.store
    assert running.service.history.flush(10)
    sessions = sorted(r.trajectory.session_id for r in store.iter_trajectories(TenantId(tid)))
    assert sessions == ["kept", "kept"]


def history_drafter_registered() -> bool:
    return "reprise" in proposer_names()


@pytest.mark.skipif(not history_drafter_registered(), reason="the history drafter ('reprise' proposer) is not registered")
def test_agent_loop_drafts_from_its_own_earlier_turns(running) -> None:
    """An agent runs the same task in two trials (as agents do, trial after trial); the second trial's
    turns draft from the first's, which the tenant's history holds."""
    tid, key = tenant_key(running)
    with RepriseClient(running.target, key) as client:
        for trial in range(2):
            messages = [{"role": "system", "content": "You are an agent. Call tools as ACTION: lookup(city)."},
                        {"role": "user", "content": "Weather in Paris?"}]
            for turn in range(2):
                reply = client.generate(messages=messages, max_new_tokens=48, session_id=f"trial-{trial}")
                messages += [{"role": "assistant", "content": reply.text},
                             {"role": "user", "content": f"OBSERVATION {turn}: sunny, 21C"}]
            running.service.history.flush(10)
    with AdminClient(running.target, running.admin_key) as admin:
        stats = admin.index_stats(tid)[0]
    assert stats.num_requests == 4 and stats.num_steps > 0
    assert stats.num_drafted_steps > 0 and stats.num_accepted_tokens >= 48  # most of trial 2 came from drafts
    assert stats.tau > 1.0 and stats.acceptance_by_position and stats.drafter_steps
    assert stats.drafter_steps.get("reprise:history", 0) > 0  # the mix says where drafts came from
    body = running.metrics()
    accepted = [line for line in body.splitlines() if line.startswith("reprise_spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) >= stats.num_accepted_tokens
    assert tid not in body  # no tenant ids in metric labels
    req = urllib.request.Request(running.http + "/dashboard/api/stats",
                                 headers={"Authorization": f"Bearer {running.admin_key}"})
    assert wait_until(lambda: any(t["tenant_id"] == tid and t["current"]["num_requests"] == 4 for t in
                                  json.loads(urllib.request.urlopen(req, timeout=10).read())["tenants"]))


def test_cancellation_and_deadlines_free_the_slot(running) -> None:
    _, key = tenant_key(running)
    service = running.service
    runner = service.decoding.engine.runner
    active = lambda: running.loop.on_loop(lambda: service.grpc.admission.num_active)
    with RepriseClient(running.target, key) as client:
        stream = client.generate_stream(tokens=[3, 4, 5], max_new_tokens=250, ignore_eos=True)
        it = iter(stream)
        next(it)
        assert active() == 1
        stream.cancel()
        assert wait_until(lambda: active() == 0 and runner.num_free_slots == 4, 5)
        with pytest.raises(RepriseError) as exc:
            client.generate(tokens=[3, 4, 5], max_new_tokens=250, ignore_eos=True, timeout=0.05)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until(lambda: active() == 0 and runner.num_free_slots == 4, 5)
        assert client.generate(tokens=[3, 4, 5], max_new_tokens=3).completion_tokens == 3


def test_tenant_cannot_reach_another_tenants_stats_or_requests(running) -> None:
    _, key_a = tenant_key(running, "a")
    tid_b, key_b = tenant_key(running, "b")
    with AdminClient(running.target, key_a) as as_tenant:
        with pytest.raises(RepriseError) as exc:
            as_tenant.index_stats(tid_b)
        assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    with RepriseClient(running.target, key_b) as b:
        with pytest.raises(RepriseError) as exc:
            b.abort("whatever-a-uses")
        assert exc.value.code == grpc.StatusCode.NOT_FOUND
    req = urllib.request.Request(running.http + "/dashboard/api/stats", headers={"Authorization": f"Bearer {key_a}"})
    with pytest.raises(urllib.error.HTTPError) as http_exc:
        urllib.request.urlopen(req, timeout=10)
    assert http_exc.value.code == 403


def test_restart_keeps_tenants_keys_and_history(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    home = tmp_path / "home"
    r = start_service(home)
    try:
        tid, key = tenant_key(r)
        with RepriseClient(r.target, key) as client:
            client.generate(tokens=[1, 2, 3], max_new_tokens=4, session_id="before")
    finally:
        r.stop(grace=5)  # graceful: the queued trajectory is written before the store closes
    r = start_service(home)
    try:
        with RepriseClient(r.target, key) as client:
            assert client.generate(tokens=[1, 2, 3], max_new_tokens=4).completion_tokens == 4
        assert next(iter(r.service.store.iter_trajectories(TenantId(tid)))).trajectory.session_id == "before"
    finally:
        r.stop()


def test_metrics_and_dashboard_after_requests(running) -> None:
    tid, key = tenant_key(running)
    with RepriseClient(running.target, key) as client:
        for _ in range(3):  # repeated text: prompt lookup finds n-grams to draft from
            list(client.generate_stream(text="ab ab ab ab ab ab ab ab ab ab", max_new_tokens=12))
    body = running.metrics()
    values = {line.split()[0]: float(line.split()[-1]) for line in body.splitlines() if line and line[0] != "#"}
    assert values["reprise_verify_steps_total"] >= 3
    assert values["reprise_spec_decode_num_draft_tokens_total"] > 0
    assert values["reprise_request_ttft_seconds_count"] == 3
    assert values['reprise_requests_total{finish_reason="length"}'] + values.get(
        'reprise_requests_total{finish_reason="eos"}', 0) == 3
    assert values['grpc_server_handled_total{grpc_code="OK",grpc_method="GenerateStream",'
                  'grpc_service="reprise.v1.DecodingService",grpc_type="server_stream"}'] == 3
    assert tid not in body
    req = urllib.request.Request(running.http + "/dashboard/api/stats",
                                 headers={"Authorization": f"Bearer {running.admin_key}"})
    assert wait_until(lambda: any(t["tenant_id"] == tid and t["current"]["num_requests"] == 3 for t in
                                  json.loads(urllib.request.urlopen(req, timeout=10).read())["tenants"]))


def test_tenant_stats_show_what_reprise_saved(running) -> None:
    """Served requests give the tenant a speedup estimate: seconds spent against the plain estimate,
    split into drafts and cache, on the admin plane, the dashboard and (service-wide) in Prometheus."""
    tid, key = tenant_key(running)
    prompt = "ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab"  # repeated: drafts, and a cached prefix
    with RepriseClient(running.target, key) as client:
        for _ in range(3):
            client.generate(text=prompt, max_new_tokens=16)
    with AdminClient(running.target, running.admin_key) as admin:
        stats = admin.index_stats(tid)[0]
    assert stats.speedup is not None and stats.speedup > 0 and stats.seconds > 0
    assert stats.plain_seconds == pytest.approx(stats.seconds + stats.seconds_saved)
    assert stats.seconds_saved == pytest.approx(stats.seconds_saved_drafts + stats.seconds_saved_cache)
    assert stats.seconds_saved_cache > 0  # the second and third requests found the prompt cached
    assert stats.tokens_per_second is not None and stats.tokens_per_second > 0
    req = urllib.request.Request(running.http + "/dashboard/api/stats",
                                 headers={"Authorization": f"Bearer {running.admin_key}"})

    def dashboard_speedup() -> float | None:
        tenants = json.loads(urllib.request.urlopen(req, timeout=10).read())["tenants"]
        return next((t["current"]["speedup"] for t in tenants if t["tenant_id"] == tid), None)

    assert wait_until(lambda: dashboard_speedup() is not None)
    body = running.metrics()
    assert 'reprise_engine_seconds_total{phase="decode"}' in body
    assert 'reprise_engine_plain_seconds_total{phase="prefill"}' in body and tid not in body


def test_example_agent_loop_runs(running, capsys) -> None:
    path = Path(__file__).resolve().parents[3] / "examples" / "agent_loop.py"
    spec = importlib.util.spec_from_file_location("agent_loop_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, key = tenant_key(running)
    code = module.main(["--server", running.target, "--api-key", key, "--admin-key", running.admin_key,
                        "--tasks", "2", "--max-turns", "2", "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0 and "model tiny-llama" in out and "task 2:" in out and "hit rate" in out


def test_tuned_settings_are_used_for_their_tenant_after_a_restart(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    home = tmp_path / "home"
    r = start_service(home)
    try:
        tuned_id, _ = tenant_key(r, "tuned")
        plain_id, _ = tenant_key(r, "plain")
        broken_id, broken_key = tenant_key(r, "broken")
        proposer = r.service.indexes._proposer
        assert proposer.settings(tuned_id)[0] == proposer.config  # nothing saved yet
    finally:
        r.stop(grace=5)
    save_drafting_config("tuned", DraftingConfig(max_draft_tokens=6, levels=1), home)  # as `reprise tune` does
    (home / "tenants" / "broken").mkdir(parents=True)
    (home / "tenants" / "broken" / "drafting.json").write_text("{not json")  # logged, not fatal
    r = start_service(home)
    try:
        proposer = r.service.indexes._proposer
        assert proposer.settings(tuned_id)[0].max_draft_tokens == 6 and proposer.settings(tuned_id)[0].levels == 1
        assert proposer.settings(plain_id)[0] == proposer.config
        assert proposer.settings(broken_id)[0] == proposer.config
        with RepriseClient(r.target, broken_key) as client:  # the tenant with the unreadable file is served
            assert client.generate(tokens=[1, 2, 3], max_new_tokens=4).completion_tokens == 4
    finally:
        r.stop()


def test_hybrid_reuse_vectors_are_sealed_and_restored_after_a_restart(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    monkeypatch.setenv("REPRISE_DRAFTER_CHECKPOINT", str(tmp_path / "no-head"))  # reuse + retrieval only
    home = tmp_path / "home"
    r = start_service(home, **{"model.drafter": "hybrid"})
    try:
        tid, key = tenant_key(r)
        with RepriseClient(r.target, key) as client:
            out = client.generate(tokens=[5, 6, 7, 8, 9], max_new_tokens=12, session_id="s1")
            client.generate(tokens=[5, 6, 7], max_new_tokens=4, session_id="s2", do_not_record=True)
        reuse = r.service.reuse
        assert reuse is not None and reuse.reuse.memory.tenant(tid).num_rows > 0
    finally:
        r.stop(grace=5)  # queued trajectory and vectors are written before the store closes
    r = start_service(home, **{"model.drafter": "hybrid"})
    try:
        store, tenant = r.service.store, TenantId(tid)
        trajectories = [rec.trajectory for rec in store.iter_trajectories(tenant)]
        assert [t.session_id for t in trajectories] == ["s1"]  # do_not_record left nothing
        tokens = trajectories[0].token_ids
        assert list(tokens[5:]) == list(out.token_ids)
        assert store.get_hidden_states(tenant, segment_key("s1", tokens)) is not None
        memory = r.service.reuse.reuse.memory.tenant(tid)
        assert memory.num_rows > 0  # restored from the sealed record at start-up
        with AdminClient(r.target, r.admin_key) as admin:
            admin.delete_tenant(tid, confirm=tid)
        assert wait_until(lambda: tid not in r.service.reuse.reuse.memory._tenants)
    finally:
        r.stop()


def test_a_holdout_measures_the_speedup_beside_the_estimate(tmp_path, monkeypatch) -> None:
    """``server.holdout_share``: a share of the tenant's requests decodes without drafts (same output) and
    the admin plane reports their per-token ratio to the drafted ones, with its interval."""
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    r = start_service(tmp_path / "home", **{"server.holdout_share": "0.5"})
    try:
        tid, key = tenant_key(r)
        prompt = "ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab"
        with RepriseClient(r.target, key) as client:
            outputs = {tuple(client.generate(text=prompt, max_new_tokens=24, ignore_eos=True).token_ids)
                       for _ in range(16)}
        assert len(outputs) == 1  # held out or not, the same output
        with AdminClient(r.target, r.admin_key) as admin:
            stats = admin.index_stats(tid)[0]
        assert stats.holdout_requests >= 2 and stats.drafted_requests >= 2
        assert stats.holdout_requests + stats.drafted_requests == 16
        assert stats.measured_speedup is not None and stats.measured_speedup > 0
        assert stats.measured_speedup_low <= stats.measured_speedup <= stats.measured_speedup_high
    finally:
        r.stop()
