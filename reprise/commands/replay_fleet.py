"""`reprise replay --replicas`: the fleet in replay (replay_traces/fleet.py).

Each trace (or, with --mix, the traces interleaved, each its own tenant) is replayed once through the
shared drafter (--drafter, Reprise by default: the tenant's history every replica reads, kept across
restarts), SuffixDecoding with vLLM's `suffix` defaults per tenant and shared the same way
(`suffixdecoding_shared`), and, per fleet size and routing, one SuffixDecoding tree per replica holding
every tenant's outputs (`suffixdecoding`, what vLLM's suffix method keeps), emptied on restart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from replay_traces.fleet import (
    PER_REPLICA,
    ROUTINGS,
    SHARED_TREE,
    FleetSpec,
    interleave,
    replay_fleet,
    trace_name,
)
from replay_traces.replay import read_calls
from replay_traces.traces import Call, TraceStats
from reprise.arguments import CliError, positive_int, positive_ints
from reprise.commands.columns import columns


def _routings(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in ROUTINGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"routing must be a comma-separated list of {', '.join(ROUTINGS)}, "
                                         f"got {text!r}")
    return names


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fleet (docs/replay.md, \"A fleet in replay\")")
    g.add_argument("--replicas", type=positive_ints, default=None, metavar="N,...",
                   help="replay through fleets of these sizes: per-replica SuffixDecoding trees (vLLM's suffix "
                   "defaults) against the shared drafter")
    g.add_argument("--routing", type=_routings, default=None, metavar="rr|sticky",
                   help="with --replicas: rr (round-robin per call), sticky (per tenant and session), or both "
                   "comma-separated (default: rr)")
    g.add_argument("--restart-every", type=positive_int, default=None, metavar="K",
                   help="with --replicas: every K calls one replica, in turn, restarts with an empty tree")
    g.add_argument("--mix", action="store_true",
                   help="merge the traces into one (each in its order, drawn at random, seeded), each its own "
                   "tenant (default fleet: --replicas 1); adds each file's figures and what tenant scoping is worth")


def fleet_requested(args: argparse.Namespace) -> bool:
    """Whether the fleet options ask for a fleet replay; CliError for options that need one but lack it."""
    if args.replicas is None and not args.mix:
        for flag, value in (("--routing", args.routing), ("--restart-every", args.restart_every)):
            if value is not None:
                raise CliError(f"{flag} applies to a fleet: add --replicas (e.g. --replicas 1,2,4,8,16)")
        return False
    if args.headroom:
        raise CliError("--headroom is a plain replay's: the shared drafter's figures do not depend on the fleet, "
                       "run it without --replicas/--mix")
    if args.mix and len(args.traces) < 2:
        raise CliError(f"--mix interleaves several traces, got {len(args.traces)}")
    return True


def run_fleet(args: argparse.Namespace, paths: list[Path], drafter: str, tokenizer: Any, config: Any,
              progress: Any) -> int:
    """The fleet replay of every trace (or of their mix); prints the table or the JSON."""
    from reprise.drafters import make_chain_proposer, make_proposer
    from retrieval.chain import ChainProposer
    from retrieval.drafters import vllm_suffix_proposer

    if drafter == "oracle":
        raise CliError("--replicas needs a drafter's sessions; the oracle's ceiling does not depend on the fleet, "
                       "run it without --replicas")
    if drafter in (PER_REPLICA, SHARED_TREE):
        raise CliError(f"--drafter {drafter} would share its name with a fleet lane; pick another drafter")
    spec = FleetSpec(args.replicas or (1,), args.routing or ("rr",), args.restart_every)

    def make_shared():
        return (make_chain_proposer if args.chain else make_proposer)(drafter, config)

    def make_tree():
        return ChainProposer(vllm_suffix_proposer(config)) if args.chain else vllm_suffix_proposer(config, tree=True)

    def select(path: Path, stats: TraceStats) -> Iterable[Call]:
        return read_calls(path, max_calls=args.max_calls, skip_bad_lines=args.skip_bad_lines, stats=stats,
                          lines=args.lines, held_out=args.held_out)

    runs: list[tuple[str, Iterable[Call], TraceStats, str]] = []
    if args.mix:
        stats = TraceStats()
        runs.append(("mix", interleave([select(p, stats) for p in paths]), stats, ",".join(map(str, paths))))
    else:
        for p in paths:
            stats = TraceStats()
            runs.append((trace_name(p), select(p, stats), stats, str(p)))
    traces: dict[str, Any] = {}
    for name, calls, stats, where in runs:
        progress.start(name, args.max_calls * (len(paths) if args.mix else 1) if args.max_calls else None)
        try:
            traces[name] = replay_fleet(calls, spec, shared_name=drafter, make_shared=make_shared,
                                        make_tree=make_tree, tokenizer=tokenizer, budget=args.budget, path=where,
                                        stats=stats, on_call=progress.on_call, mix=args.mix)
        except (ValueError, OSError, EOFError) as exc:
            raise CliError(str(exc)) from None
        finally:
            progress.close()
    result = {"drafter": drafter, "replica_drafter": "suffixdecoding_vllm" + ("" if args.chain else " (trees)"),
              "budget": args.budget, "chain": args.chain, "tokenizer": args.tokenizer,
              "replicas": list(spec.replicas), "routing": list(spec.routings), "restart_every": spec.restart_every,
              "mix": args.mix, "lines": list(args.lines) if args.lines else None, "held_out": args.held_out,
              "traces": traces}
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(format_fleet(result))
    return 0


def format_fleet(result: dict[str, Any]) -> str:
    """The human tables: per trace (and per routing), one row per fleet size."""
    drafter = result["drafter"]
    shape = "one path per step" if result["chain"] else "trees"
    restart = f", a replica restarts every {result['restart_every']} calls" if result["restart_every"] else ""
    lines = [(f"shared: {drafter} (per tenant, every replica, kept across restarts); per replica: {PER_REPLICA} "
              f"with vLLM's suffix defaults, every tenant in one tree; budget {result['budget']} ({shape}){restart}")]
    for name, t in result["traces"].items():
        routings = t.get("routings") or {result["routing"][0]: {"replicas": t["replicas"]}}
        rows: list[tuple[str, ...]] = [("routing", "replicas", f"tau {drafter}", f"tau {PER_REPLICA}", "ratio",
                                        f"tau {SHARED_TREE}", "accept (per replica)", "hit (per replica)",
                                        "restarts")]
        for routing, r in routings.items():
            for n, e in r["replicas"].items():
                rows.append((routing, n, f"{e['tau'][drafter]:.3f}", f"{e['tau'][PER_REPLICA]:.3f}",
                             f"{e['ratio']:.2f}x", f"{e['tau'][SHARED_TREE]:.3f}",
                             f"{e['acceptance_rate'][PER_REPLICA]:.3f}", f"{e['hit_rate'][PER_REPLICA]:.3f}",
                             f"{e['restarts']}"))
        lines += ["", f"{name}: {t['calls']} calls, {t['tokens']} response tokens", columns(rows)]
        if "scoping" in t:
            lines += ["", "tenant scoping (one replica, no restart): tau per tenant / one state for everyone",
                      _scoping_table(t, drafter)]
    return "\n".join(lines)


def _scoping_table(t: dict[str, Any], drafter: str) -> str:
    rows: list[tuple[str, ...]] = [("file", f"{drafter} per tenant", f"{drafter} global", f"{PER_REPLICA} per tenant",
                                    f"{PER_REPLICA} global")]
    for name, s in [("(all)", t["scoping"]), *((g, v["scoping"]) for g, v in t["groups"].items())]:
        rows.append((name, f"{s[drafter]['per_tenant']:.3f}", f"{s[drafter]['global']:.3f}",
                     f"{s[PER_REPLICA]['per_tenant']:.3f}", f"{s[PER_REPLICA]['global']:.3f}"))
    return columns(rows)
