"""`reprise replay --replicas / --mix`: the fleet's JSON and table, its errors, and that its shared lane is
the plain replay's figure (on a slice of a shared trace when the folder is there)."""

from __future__ import annotations

import json
import re

import pytest
from testkit.replay import conversation, write_trace

from reprise.cli import main

ANSWER = "Checked the booking: flight HAT045 on 2024-05-18, seat 12C, paid with card ending 4521."


@pytest.fixture
def trace(tmp_path):
    lines = [conversation("acme", f"s{i}", ("system", "You are an airline agent."), ("user", f"question {i}"),
                          ("assistant", ANSWER), ("user", "thanks"), ("assistant", f"You are welcome ({i})."))
             for i in range(6)]
    return write_trace(tmp_path / "tiny.jsonl.gz", lines)


def _json(argv, capsys) -> dict:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def test_fleet_json_has_the_issue_shape(trace, capsys):
    data = _json(["replay", str(trace), "--replicas", "1,2,4", "--chain", "--json"], capsys)
    assert data["replicas"] == [1, 2, 4] and data["routing"] == ["rr"] and data["chain"] is True
    entry = data["traces"]["tiny"]
    assert set(entry["replicas"]) == {"1", "2", "4"}
    for n, e in entry["replicas"].items():
        assert set(e["tau"]) == {"reprise", "suffixdecoding", "suffixdecoding_shared"}
        assert e["routing"] == "rr" and len(e["calls_per_replica"]) == int(n)
        assert e["ratio"] == pytest.approx(e["tau"]["reprise"] / e["tau"]["suffixdecoding"])
        for figure in ("acceptance_rate", "draft_tokens_per_step", "hit_rate"):
            assert set(e[figure]) == set(e["tau"])
    # Six sessions give the same answer: one tree of everything drafts it, four replicas' trees less.
    taus = [entry["replicas"][n]["tau"]["suffixdecoding"] for n in ("1", "2", "4")]
    assert taus[0] > taus[2]
    assert {"reprise", "suffixdecoding_shared", "suffixdecoding/rr/1", "suffixdecoding/rr/4"} <= set(entry["lanes"])
    assert "routings" not in entry


def test_several_routings_and_restarts(trace, capsys):
    data = _json(["replay", str(trace), "--replicas", "2", "--routing", "rr,sticky", "--restart-every", "3",
                  "--json"], capsys)
    entry = data["traces"]["tiny"]
    assert set(entry["routings"]) == {"rr", "sticky"}
    assert entry["routings"]["sticky"]["replicas"]["2"]["routing"] == "sticky"
    assert entry["replicas"] == entry["routings"]["rr"]["replicas"]
    assert entry["replicas"]["2"]["restarts"] == 3  # before calls 3, 6 and 9 of 12
    assert data["replica_drafter"] == "suffixdecoding_vllm (trees)"


def test_the_table(trace, capsys):
    assert main(["replay", str(trace), "--replicas", "1,8", "--routing", "sticky"]) == 0
    out = capsys.readouterr().out
    assert "tiny: 12 calls" in out and "tau suffixdecoding" in out and "ratio" in out
    assert re.search(r"^sticky\s+8\s", out, re.MULTILINE)


def test_mix_json_and_table(tmp_path, trace, capsys):
    other = write_trace(tmp_path / "other.jsonl", [conversation("acme", "o", ("user", "hi"), ("assistant", ANSWER))])
    data = _json(["replay", str(trace), str(other), "--mix", "--chain", "--json"], capsys)
    entry = data["traces"]["mix"]
    assert data["replicas"] == [1] and set(entry["groups"]) == {"tiny", "other"}
    assert entry["calls"] == 13
    assert set(entry["scoping"]) == {"reprise", "suffixdecoding"} and "reprise_global" in entry["lanes"]
    alone = _json(["replay", str(other), "--chain", "--json"], capsys)["files"][0]
    assert entry["groups"]["other"]["scoping"]["reprise"]["per_tenant"] == alone["tau"]  # tenants share nothing
    assert main(["replay", str(trace), str(other), "--mix"]) == 0
    assert "tenant scoping" in capsys.readouterr().out


def test_lines_and_held_out_select_calls(trace, capsys):
    one = _json(["replay", str(trace), "--lines", "2-3", "--json", "--drafter", "prompt_lookup"], capsys)
    assert one["files"][0]["calls"] == 4
    fleet = _json(["replay", str(trace), "--lines", "2-3", "--replicas", "1", "--json"], capsys)
    assert fleet["traces"]["tiny"]["calls"] == 4 and fleet["lines"] == [2, 3]
    held = _json(["replay", str(trace), "--held-out", "1", "--json", "--drafter", "prompt_lookup"], capsys)
    assert held["files"][0]["calls"] == 12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--routing", "rr"], "--routing applies to a fleet: add --replicas"),
        (["--restart-every", "5"], "--restart-every applies to a fleet"),
        (["--replicas", "0"], "expected comma-separated positive integers"),
        (["--replicas", "2", "--routing", "random"], "routing must be a comma-separated list of rr, sticky"),
        (["--mix"], "--mix interleaves several traces, got 1"),
        (["--replicas", "2", "--drafter", "oracle"], "--replicas needs a drafter's sessions"),
        (["--replicas", "2", "--chain", "--headroom"], "--headroom is a plain replay's"),
        (["--replicas", "2", "--drafter", "suffixdecoding"], "would share its name with a fleet lane"),
        (["--lines", "9-3"], "expected FIRST-LAST with 1 <= FIRST <= LAST"),
        (["--held-out", "1.5"], r"expected a share in \(0, 1\]"),
    ],
)
def test_clean_errors(trace, capsys, argv, message):
    try:
        code = main(["replay", str(trace), *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_one_replica_is_the_plain_replay_on_a_shared_trace(traces_dir, capsys):
    # The shared lane is today's `reprise replay --chain`, and one replica's tree of a one-tenant file is
    # the vLLM-default anchor's, whatever the fleet around them.
    path = str(traces_dir / "tau_airline.jsonl.gz")
    plain = _json(["replay", path, "--max-calls", "150", "--chain", "--json"], capsys)["files"][0]
    anchor = _json(["replay", path, "--max-calls", "150", "--chain", "--json", "--drafter", "suffixdecoding_vllm"],
                   capsys)["files"][0]
    fleet = _json(["replay", path, "--max-calls", "150", "--chain", "--json", "--replicas", "1,8"], capsys)
    entry = fleet["traces"]["tau_airline"]
    assert entry["lanes"]["reprise"]["steps"] == plain["steps"]
    assert entry["replicas"]["8"]["tau"]["reprise"] == plain["tau"]
    assert entry["replicas"]["1"]["tau"]["suffixdecoding"] == anchor["tau"]
    assert entry["replicas"]["8"]["tau"]["suffixdecoding_shared"] == anchor["tau"]
    assert entry["replicas"]["8"]["tau"]["suffixdecoding"] < anchor["tau"]
