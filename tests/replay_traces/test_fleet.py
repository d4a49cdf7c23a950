"""The fleet in replay (replay_traces/fleet.py): routing, restarts, and the per-replica / shared split on
hand-made traces whose answer is known by construction."""

from __future__ import annotations

import numpy as np
import pytest
from testkit.replay import CharTokenizer, conversation, write_trace

from replay_traces.fleet import (
    EVERYONE,
    PER_REPLICA,
    SHARED_TREE,
    Fleet,
    FleetSpec,
    GlobalScope,
    interleave,
    replay_fleet,
    route,
)
from replay_traces.replay import read_calls, replay_calls
from replay_traces.traces import iter_calls
from retrieval.chain import ChainProposer
from retrieval.config import DraftingConfig
from retrieval.drafters import SuffixDecodingProposer, vllm_suffix_proposer
from retrieval.registry import make_proposer

# 60 distinct characters no prompt contains: a replica that never saw this response cannot draft any of it
# (its own output never repeats a token), one that did drafts most of it.
RESPONSE = "".join(chr(0x4E00 + i) for i in range(60))


class Recorder:
    """A proposer double that records which calls it began and whether it was taught a vocabulary."""

    made = 0

    def __init__(self) -> None:
        Recorder.made += 1
        self.serial = Recorder.made
        self.begun: list[str] = []
        self.vocabulary = None

    def set_vocabulary(self, decode, vocab_size) -> None:
        self.vocabulary = vocab_size

    def begin(self, tenant, session_id, prompt_ids, request_id=""):
        self.begun.append(request_id)
        return (tenant, session_id)


def test_round_robin_cycles_over_the_replicas_call_by_call():
    assert [route("rr", k, "t", "s", 3) for k in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [route("rr", k, "t", "s", 1) for k in range(3)] == [0, 0, 0]


def test_sticky_keeps_a_session_on_one_replica_and_spreads_sessions():
    for session in ("a", "b", "c"):
        assert len({route("sticky", k, "t", session, 8) for k in range(20)}) == 1
    spread = {route("sticky", 0, "t", f"s{i}", 8) for i in range(200)}
    assert spread == set(range(8))
    # The tenant is part of the key: the same session id of two tenants may land apart.
    assert {route("sticky", 0, f"t{i}", "s", 8) for i in range(50)} != {route("sticky", 0, "t0", "s", 8)}


def test_routing_and_sizes_are_checked():
    with pytest.raises(ValueError, match="unknown routing 'random'"):
        route("random", 0, "t", "s", 2)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        Fleet(Recorder, 0)
    with pytest.raises(ValueError, match="restart_every must be >= 1, got 0"):
        Fleet(Recorder, 2, restart_every=0)
    with pytest.raises(ValueError, match="replicas must be sizes >= 1"):
        FleetSpec(())
    with pytest.raises(ValueError, match="unknown routing 'lb'"):
        FleetSpec((1,), ("lb",))


def test_a_fleet_begins_each_call_on_the_routed_replica():
    fleet = Fleet(Recorder, 2, "rr")
    for k in range(5):
        fleet.begin("t", "s", [1], str(k))
    assert [r.begun for r in fleet.replicas] == [["0", "2", "4"], ["1", "3"]]
    assert fleet.calls_per_replica == [3, 2] and fleet.restarts == 0


def test_restarts_replace_one_replica_in_turn_every_k_calls():
    fleet = Fleet(Recorder, 2, "rr", restart_every=2)
    fleet.set_vocabulary(chr, 99)
    first = [r.serial for r in fleet.replicas]
    for k in range(7):
        fleet.begin("t", "s", [1], str(k))
    # Before call 2 replica 0 restarts, before call 4 replica 1, before call 6 replica 0 again.
    assert fleet.restarts == 3
    assert fleet.replicas[0].begun == ["6"] and fleet.replicas[1].begun == ["5"]
    assert all(r.serial not in first for r in fleet.replicas)
    assert all(r.vocabulary == 99 for r in fleet.replicas)  # a restarted replica is taught it again


def test_global_scope_drafts_every_tenant_from_one_state():
    inner = Recorder()
    GlobalScope(inner).begin("acme", "s", [1], "0")
    assert inner.begin("x", "y", [1]) == ("x", "y")
    scoped = GlobalScope(Recorder())
    assert scoped.begin("acme", "s", [1]) == (EVERYONE, "s")


def _one_call(session: str, prompt: str, tenant: str = "t") -> dict:
    return conversation(tenant, session, ("user", prompt), ("assistant", RESPONSE))


def _fleet(path, spec: FleetSpec, chain: bool = True, mix_paths=None) -> dict:
    config = DraftingConfig()

    def make_tree():
        return ChainProposer(vllm_suffix_proposer(config)) if chain else vllm_suffix_proposer(config, tree=True)

    if mix_paths:
        calls = interleave([iter_calls(p) for p in mix_paths])
    else:
        calls = iter_calls(path)
    return replay_fleet(calls, spec, shared_name="reprise", make_shared=lambda: ChainProposer(make_proposer("reprise")),
                        make_tree=make_tree, tokenizer=CharTokenizer(), budget=32, mix=bool(mix_paths))


def test_round_robin_splits_a_repeated_response_from_the_tree_that_holds_it(tmp_path):
    # Two sessions answer the same thing. On one replica (or through the shared history) the second drafts
    # the first's answer; round-robin over two replicas sends it to a replica whose tree never saw it.
    path = write_trace(tmp_path / "t.jsonl", [_one_call("a", "first question"), _one_call("b", "second one")])
    result = _fleet(path, FleetSpec((1, 2), ("rr",)))
    one, two = result["replicas"]["1"], result["replicas"]["2"]
    assert result["calls"] == 2 and result["tokens"] == 120
    assert two["tau"][PER_REPLICA] == 1.0  # 120 tokens, one a step: nothing drafted was right
    assert result["lanes"][f"{PER_REPLICA}/rr/2"]["accepted_tokens"] == 0
    assert one["tau"][PER_REPLICA] > 1.5
    for entry in (one, two):  # the shared memories do not depend on the fleet
        assert entry["tau"]["reprise"] == one["tau"]["reprise"] > 1.5
        assert entry["tau"][SHARED_TREE] == one["tau"][PER_REPLICA]
    assert two["ratio"] == pytest.approx(two["tau"]["reprise"])
    assert two["calls_per_replica"] == [1, 1] and one["calls_per_replica"] == [2]


def test_sticky_routing_follows_the_session(tmp_path):
    # Find two session ids that land on the same replica of two, and two that land apart.
    home = route("sticky", 0, "t", "s0", 2)
    same = next(s for s in (f"s{i}" for i in range(1, 100)) if route("sticky", 0, "t", s, 2) == home)
    apart = next(s for s in (f"s{i}" for i in range(1, 100)) if route("sticky", 0, "t", s, 2) != home)
    together = write_trace(tmp_path / "a.jsonl", [_one_call("s0", "first question"), _one_call(same, "second one")])
    split = write_trace(tmp_path / "b.jsonl", [_one_call("s0", "first question"), _one_call(apart, "second one")])
    assert _fleet(together, FleetSpec((2,), ("sticky",)))["replicas"]["2"]["tau"][PER_REPLICA] > 1.5
    assert _fleet(split, FleetSpec((2,), ("sticky",)))["replicas"]["2"]["tau"][PER_REPLICA] == 1.0


def test_a_restart_empties_the_replica_tree_but_not_the_shared_history(tmp_path):
    lines = [_one_call("a", "first question"), _one_call("b", "second one"), _one_call("c", "third")]
    path = write_trace(tmp_path / "t.jsonl", lines)
    first_two = _fleet(write_trace(tmp_path / "two.jsonl", lines[:2]), FleetSpec((1,)))["lanes"][f"{PER_REPLICA}/rr/1"]
    kept = _fleet(path, FleetSpec((1,), ("rr",)))
    restarted = _fleet(path, FleetSpec((1,), ("rr",), restart_every=2))
    assert restarted["replicas"]["1"]["restarts"] == 1 and kept["replicas"]["1"]["restarts"] == 0
    # Call c runs on the replica restarted just before it: its 60 tokens take 60 steps.
    assert restarted["lanes"][f"{PER_REPLICA}/rr/1"]["steps"] == first_two["steps"] + 60
    assert kept["lanes"][f"{PER_REPLICA}/rr/1"]["steps"] < first_two["steps"] + 60
    kept, restarted = kept["replicas"]["1"], restarted["replicas"]["1"]
    assert restarted["tau"]["reprise"] == kept["tau"]["reprise"]
    assert restarted["tau"][SHARED_TREE] == kept["tau"][SHARED_TREE]


def test_the_shared_lane_is_the_plain_replay_whatever_the_fleet(tmp_path):
    words = ["alpha beta gamma", "delta epsilon", "alpha beta gamma delta"]
    lines = [conversation("t", f"s{i % 3}", ("user", f"task {i}"), ("assistant", f"{words[i % 3]} done {i}"),
                          ("user", "next"), ("assistant", f"{words[(i + 1) % 3]} again"))
             for i in range(9)]
    path = write_trace(tmp_path / "t.jsonl", lines)
    plain = replay_calls(iter_calls(path), ChainProposer(make_proposer("reprise")), CharTokenizer(), budget=32)
    anchor = replay_calls(iter_calls(path), ChainProposer(make_proposer("suffixdecoding_vllm")), CharTokenizer(),
                          budget=32)
    result = _fleet(path, FleetSpec((1, 2, 4), ("rr", "sticky"), restart_every=3))
    for routing in ("rr", "sticky"):
        for entry in result["routings"][routing]["replicas"].values():
            assert entry["tau"]["reprise"] == plain.tau
            assert entry["tau"][SHARED_TREE] == anchor.tau
    assert result["lanes"]["reprise"]["steps"] == plain.steps


def test_trees_without_chain(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [_one_call("a", "first question"), _one_call("b", "second one")])
    result = _fleet(path, FleetSpec((1, 2)), chain=False)
    assert result["replicas"]["2"]["tau"][PER_REPLICA] == 1.0
    assert result["replicas"]["1"]["tau"][PER_REPLICA] > 1.5


def test_a_mix_keeps_tenants_apart_per_file_and_measures_scoping(tmp_path):
    # Each file's sessions repeat the same answer; file b's tenant has the same name as file a's but
    # is another tenant in the mix. One global state drafts from a's answers whatever comes first.
    a = write_trace(tmp_path / "a.jsonl", [_one_call("x", "question a1"), _one_call("y", "question a2")])
    b = write_trace(tmp_path / "b.jsonl", [_one_call("z", "question b1")])
    mixed = list(interleave([iter_calls(a), iter_calls(b)]))
    assert [c.index for c in mixed] == [0, 1, 2]
    assert [c.session for c in mixed if c.tenant == "a:t"] == ["x", "y"]
    assert [c.session for c in mixed if c.tenant == "b:t"] == ["z"]
    result = _fleet(None, FleetSpec((1,)), mix_paths=[a, b])
    assert set(result["groups"]) == {"a", "b"}
    for figures in (result["scoping"][PER_REPLICA], result["scoping"]["reprise"]):
        # Per tenant, a's second call drafts from its first (120 tokens in fewer than 120 steps + 60);
        # one state for all drafts two of the three calls from an earlier one.
        assert figures["global"] > figures["per_tenant"] > 1.0
    b_alone = result["groups"]["b"]["scoping"]
    assert b_alone[PER_REPLICA]["per_tenant"] == b_alone["reprise"]["per_tenant"] == 1.0
    assert result["groups"]["a"]["replicas"]["1"]["tau"]["reprise"] > 1.5
    assert result["groups"]["b"]["calls"] == 1 and result["calls"] == 3


def test_a_mix_is_each_trace_in_order_merged_at_random(tmp_path):
    paths = [write_trace(tmp_path / f"{name}.jsonl", [_one_call(f"{name}{i}", "q") for i in range(40)])
             for name in ("a", "b")]
    mixed = [c.session for c in interleave([iter_calls(p) for p in paths])]
    assert mixed == [c.session for c in interleave([iter_calls(p) for p in paths])]  # seeded
    assert [s for s in mixed if s.startswith("a")] == [f"a{i}" for i in range(40)]
    assert mixed != [f"{n}{i}" for i in range(40) for n in "ab"]  # not a fixed alternation
    assert {s[0] for s in mixed[:20]} == {"a", "b"} and {s[0] for s in mixed[-20:]} == {"a", "b"}


def test_the_vllm_tree_keeps_only_its_newest_responses():
    # Arctic's max_cached_requests: the oldest response leaves the tree when a new request starts.
    tok = CharTokenizer()
    proposer = SuffixDecodingProposer(DraftingConfig(max_depth=24, use_tree=False, max_spec_factor=1.0,
                                                     min_token_prob=0.1), max_cached_requests=2)
    answers = ["".join(chr(0x4E00 + 100 * k + i) for i in range(30)) for k in range(3)]
    for k, answer in enumerate(answers):
        s = proposer.begin("t", f"s{k}", tok.encode("q"))
        for token in tok.encode(answer):
            s.commit(_tokens(token))
        s.finish()
    s = proposer.begin("t", "s9", tok.encode("q"))  # evicts answers[1]: the tree holds answers[2] and this
    s.commit(_tokens(tok.encode(answers[0])[0]))
    assert len(s.propose(8)) == 0
    s.commit(_tokens(tok.encode(answers[2])[0]))
    assert len(s.propose(8)) == 1  # one matched token drafts one (spec factor 1.0)
    with pytest.raises(ValueError, match="max_cached_requests must be >= 0"):
        SuffixDecodingProposer(max_cached_requests=-1)


def _tokens(token) -> object:
    from retrieval.session import Verified

    return Verified.tokens(np.asarray([token], dtype=np.int32))


def test_read_calls_selects_lines_and_held_out_sessions(tmp_path):
    lines = [conversation("t", f"s{i}", ("user", "q"), ("assistant", f"a{i}"), ("user", "q"), ("assistant", "b"))
             for i in range(40)]
    path = write_trace(tmp_path / "t.jsonl", lines)
    picked = list(read_calls(path, lines=(3, 5)))
    assert [c.line_no for c in picked] == [3, 3, 4, 4, 5, 5]
    held = list(read_calls(path, held_out=0.25))
    sessions = {c.session for c in held}
    assert 0 < len(sessions) < 40 and all(c.session in sessions for c in held)
    assert {c.session for c in read_calls(path, held_out=0.5)} >= sessions  # a larger share holds these too
    assert len(list(read_calls(path, held_out=0.25, max_calls=3))) == 3
    with pytest.raises(ValueError, match="lines must be FIRST-LAST"):
        read_calls(path, lines=(5, 3))
    with pytest.raises(ValueError, match="held_out must be in"):
        read_calls(path, held_out=0.0)
