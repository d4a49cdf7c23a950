"""Fair share of decoding slots: the policy (reprise/engine/fair_share.py) and the own engine's preemption,
whose parked requests resume exactly where they were (greedy: the same tokens; seeded sampling: the same
draws), with or without a prefix cache to keep their rows."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from reprise.engine import fair_share
from reprise.engine.engine import Engine, EngineConfig
from reprise.offline.tiny import TINY_EOS, TINY_VOCAB, byte_level_tokenizer, tiny_llama
from retrieval.registry import make_proposer
from serving.records import Request
from verifier.runner import ModelRunner
from verifier.testing import hf_greedy

# ---- the policy -----------------------------------------------------------------------------------


def test_a_free_slot_goes_to_the_oldest_request_of_the_tenant_holding_fewest() -> None:
    assert fair_share.next_waiting({}, ["a", "b", "a"]) == 0
    assert fair_share.next_waiting({"a": 3, "b": 1}, ["a", "a", "b", "c", "b"]) == 3
    assert fair_share.next_waiting({"a": 3, "b": 1}, ["a", "b", "b"]) == 1
    with pytest.raises(ValueError, match="no request is waiting"):
        fair_share.next_waiting({"a": 1}, [])


def test_the_tenant_holding_the_most_yields_only_to_a_tenant_holding_two_fewer() -> None:
    assert fair_share.yielding_tenant({"a": 8}, ["b"]) == "a"
    assert fair_share.yielding_tenant({"a": 6, "b": 2}, ["b", "a"]) == "a"
    assert fair_share.yielding_tenant({"a": 5, "b": 3}, ["b"]) == "a"
    assert fair_share.yielding_tenant({"a": 4, "b": 4}, ["b", "a"]) is None
    assert fair_share.yielding_tenant({"a": 5, "b": 4}, ["b"]) is None  # one more is as even as it gets
    assert fair_share.yielding_tenant({"a": 8}, ["a"]) is None  # a tenant never yields to itself
    assert fair_share.yielding_tenant({"a": 8}, []) is None
    assert fair_share.yielding_tenant({"a": 1, "b": 1}, ["c"]) is None  # more tenants than slots: wait


def test_admission_order_is_next_waiting_applied_in_turn() -> None:
    assert fair_share.admission_order({"a": 2}, ["a", "a", "b", "b", "c"]) == [2, 4, 3, 0, 1]
    assert fair_share.admission_order({}, []) == []


@pytest.mark.parametrize("seed", range(30))
def test_yields_and_admissions_reach_max_min_fair_shares_and_stop(seed: int) -> None:
    """Slots start in any hands; tenants have any number of requests waiting. Applying the two rules
    until neither moves a slot ends (no cycle), with every tenant that still waits holding at least as
    many slots as any other tenant holds, less one: max-min fairness."""
    rng = random.Random(seed)
    num_slots = rng.randint(1, 12)
    tenants = "abcde"[: rng.randint(1, 5)]
    held = {t: 0 for t in tenants}
    for _ in range(num_slots):
        held[rng.choice(tenants)] += 1
    waiting = [t for t in tenants for _ in range(rng.randint(0, 6))]
    rng.shuffle(waiting)
    for moves in range(1000):
        if sum(held.values()) < num_slots and waiting:
            pick = waiting.pop(fair_share.next_waiting(held, waiting))
            held[pick] += 1
            continue
        tenant = fair_share.yielding_tenant({t: n for t, n in held.items() if n}, waiting)
        if tenant is None:
            break
        held[tenant] -= 1
        waiting.insert(0, tenant)
    else:
        pytest.fail("the rules went round in circles")
    assert moves < num_slots * 3 + len(tenants) * 8
    for t in set(waiting):
        assert held[t] >= max(held.values()) - 1, (held, waiting)


# ---- the own engine -------------------------------------------------------------------------------

LONG = 40


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=11)


def make_engine(model, num_slots: int = 2, cache: bool = True, drafter: str = "prompt_lookup",
                tokenizer=None) -> Engine:
    runner = ModelRunner(model, num_slots=num_slots, max_len=256, max_draft_nodes=16,
                         prefix_cache_bytes=(1 << 24) if cache else 0, prefix_block_size=8)
    return Engine(runner, make_proposer(drafter), tokenizer, EngineConfig(eos_token_ids=(TINY_EOS,)))


def prompt(seed: int, n: int = 20) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(3, TINY_VOCAB, n).tolist() * 2)  # repeats: drafts find some


def flood(engine: Engine, n: int, record: bool = True):
    """Tenant a fills the slots, steps a few times; then tenant b's short request arrives."""
    a = [engine.submit(Request.of_tokens(prompt(i), tenant="a", max_new_tokens=LONG, ignore_eos=True, record=record))
         for i in range(n)]
    for _ in range(3):
        engine.step()
    b = engine.submit(Request.of_tokens(prompt(99, 6), tenant="b", max_new_tokens=4, ignore_eos=True))
    return a, b


@pytest.mark.parametrize("cache", [True, False], ids=["rows-cached", "rows-recomputed"])
@pytest.mark.parametrize("record", [True, False], ids=["recorded", "not-recorded"])
def test_a_waiting_tenant_takes_a_slot_at_the_next_step_and_greedy_outputs_stay_generates(model, cache,
                                                                                            record) -> None:
    engine = make_engine(model, cache=cache)
    a, b = flood(engine, 2, record=record)
    engine.step()
    assert sorted(item.handle.request.tenant for item in engine._active) == ["a", "b"]
    assert engine.preemptions == 1
    engine.run_until_idle()
    assert b.wait().finish_reason == "length"
    for i, handle in enumerate(a):
        assert list(handle.wait().token_ids) == hf_greedy(model, list(prompt(i)), LONG)
    assert engine.runner.num_free_slots == 2
    if engine.runner.prefix_cache is not None:
        engine.runner.prefix_cache.check_integrity()
        if not record:  # a request that asked not to be recorded leaves nothing behind, parked or not
            assert engine.runner.prefix_cache.scope_stats("a").num_blocks == 0


def test_a_parked_request_resumes_from_its_cached_rows(model) -> None:
    engine = make_engine(model)
    flood(engine, 2)
    engine.step()
    parked = next(entry.resumes for entry in engine._waiting if entry.resumes is not None)
    assert parked.parked is not None and len(parked.stop.token_ids) >= 3
    stats = engine.runner.prefix_cache.scope_stats("a")
    assert stats.num_blocks * 8 >= len(parked.parked.context) - 8  # its committed rows, whole blocks
    engine.run_until_idle()
    assert engine.runner.prefix_cache.scope_stats("a").query_tokens == stats.query_tokens  # a resume is no prompt


def test_seeded_sampling_draws_the_same_after_resuming(model) -> None:
    """Tenant a's seeded sampled request (not speculating: one draw per step whatever the batch) is the
    newest of a's two when b's requests come, one after another: it yields its slot each time, and its
    output is what it samples alone."""
    sampled = Request.of_tokens(prompt(0), tenant="a", max_new_tokens=LONG, ignore_eos=True, temperature=0.9,
                                top_p=0.95, seed=1234, speculate=False)
    alone = make_engine(model, num_slots=1)
    expected = alone.submit(sampled)
    alone.run_until_idle()
    engine = make_engine(model, num_slots=2)
    engine.submit(Request.of_tokens(prompt(1), tenant="a", max_new_tokens=LONG, ignore_eos=True))
    a = engine.submit(sampled)
    b = []
    for step in range(4 * LONG):
        if step % 10 == 3:
            b.append(engine.submit(Request.of_tokens(prompt(50 + step, 6), tenant="b", max_new_tokens=3)))
        if not engine.has_work:
            break
        engine.step()
    assert engine.preemptions >= 2
    assert a.wait().token_ids == expected.wait().token_ids
    assert all(h.wait().finish_reason in ("length", "eos") for h in b)


def test_grammar_and_stop_strings_survive_a_preemption(model) -> None:
    xgr = pytest.importorskip("xgrammar")
    del xgr
    from reprise.engine.grammar_compiler import GrammarCompiler
    from serving.records import OutputConstraint

    tokenizer = byte_level_tokenizer()
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 400}},
              "required": ["city", "days"]}
    grammar = GrammarCompiler(tokenizer, TINY_VOCAB, [TINY_EOS]).compile(OutputConstraint(json.dumps(schema)),
                                                                        tenant="a", max_tokens=60)
    requests = [(Request.of_tokens(tokenizer.encode("where to?"), tenant="a", max_new_tokens=60), grammar),
                (Request.of_tokens(tokenizer.encode("say it"), tenant="a", max_new_tokens=LONG, stop=("zq",),
                                   ignore_eos=True), None)]

    def run(preempt: bool) -> list[tuple[tuple[int, ...], str, str]]:
        engine = make_engine(model, tokenizer=tokenizer, drafter="reprise")
        handles = [engine.submit(r, grammar=g) for r, g in requests]
        engine.step()
        engine.step()
        if preempt:
            engine.submit(Request.of_tokens(tokenizer.encode("hi"), tenant="b", max_new_tokens=5))
        engine.run_until_idle()
        assert engine.preemptions == int(preempt)
        return [(h.wait().token_ids, h.wait().text, h.wait().finish_reason) for h in handles]

    alone, preempted = run(False), run(True)
    assert preempted == alone
    assert json.loads(alone[0][1])["city"] in ("Paris", "Oslo", "Rome")


def test_a_request_cancelled_while_parked_ends_with_what_it_had(model) -> None:
    engine = make_engine(model)
    _, b = flood(engine, 2)
    engine.step()
    parked = next(entry for entry in engine._waiting if entry.resumes is not None)
    committed = list(parked.resumes.stop.token_ids)
    parked.handle.cancel()
    engine.run_until_idle()
    result = parked.handle.wait()
    assert result.finish_reason == "aborted" and list(result.token_ids) == committed
    assert b.wait().finish_reason == "length"
    assert engine.runner.num_free_slots == 2 and not engine.has_work


def test_streams_of_a_parked_request_carry_every_token_once(model) -> None:
    engine = make_engine(model)
    streamed: list[int] = []
    a = [engine.submit(Request.of_tokens(prompt(i), tenant="a", max_new_tokens=LONG, ignore_eos=True),
                       on_stream=(lambda ids, text: streamed.extend(ids)) if i == 1 else None) for i in range(2)]
    for _ in range(3):
        engine.step()
    engine.submit(Request.of_tokens(prompt(99, 6), tenant="b", max_new_tokens=4))
    engine.run_until_idle()
    assert engine.preemptions == 1
    assert streamed == list(a[1].wait().token_ids)
