"""`reprise replay`: the canonical replay of agent traces through a drafter.

Every LLM call of each trace (docs/replay.md) is decoded against its recorded response:
each step the drafter proposes a tree of at most --budget tokens, greedy verification accepts the
longest matching root path plus one bonus token. Printed per file:

  tau            response tokens / verification steps (upper bound on speedup in target passes)
  draft/step     drafted tokens per step
  accept         accepted draft tokens / drafted tokens
  hit            steps with a non-empty draft / steps
  spec p50/p99   time of one propose() call, microseconds
  by position k  steps accepting >= k draft tokens / steps with a non-empty draft

With --chain every step sends one path (the path a chain verifier such as vLLM's is sent: the best
path of a wider tree, retrieval/chain.py) instead of a tree; the figures then say what a chain verifier
would get. --headroom (with --chain) adds what a better first token would win: the taus the chain
would have had, step by step, had it started with the better of the tree's 2 or 4 best roots for the
truth, with whichever root was right, or had the whole tree been verified (replay_traces/headroom.py).

--replicas 1,2,4,8,16 replays a fleet: the shared drafter (the tenant's history every replica reads,
kept across restarts) against one SuffixDecoding tree per replica with vLLM's suffix defaults, every
tenant in it, fed only the calls routed to it (--routing rr|sticky), emptied when it restarts
(--restart-every K); --mix merges the traces into one, each its own tenant (replay_traces/fleet.py).

Drafter "oracle" is the copy limit: the longest continuation of the recorded response visible to any
retrieval drafter (tenant history, prompt, output so far), the ceiling for every retrieval drafter.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from replay_traces.headroom import FIGURES, ChainHeadroom
from replay_traces.oracle import CopyLimitOracle
from replay_traces.replay import read_calls, replay_calls
from replay_traces.tokenizer import CanonicalTokenizer
from replay_traces.traces import Call, TraceStats
from reprise.arguments import CliError, positive_int
from reprise.commands.columns import columns
from reprise.commands.replay_fleet import add_fleet_arguments, fleet_requested, run_fleet
from retrieval.config import MAX_DRAFT_TOKENS, DraftingConfig
from retrieval.session import Proposer

ORACLE = "oracle"
_SHOWN_POSITIONS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def _budget(text: str) -> int:
    value = positive_int(text)
    if value > MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"budget must be at most {MAX_DRAFT_TOKENS}, got {value}")
    return value


def add_trace_arguments(parser: argparse.ArgumentParser, default_max_calls: int | None = None) -> None:
    """Arguments `replay` and `tune` share."""
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (.jsonl or .jsonl.gz)")
    parser.add_argument("--max-calls", type=positive_int, default=default_max_calls, metavar="N",
                        help="replay only the first N calls of each file (default: "
                        f"{default_max_calls if default_max_calls else 'all'})")
    parser.add_argument("--tokenizer", default="cl100k_base", metavar="NAME",
                        help="bpe_openai encoding (default: cl100k_base, the canonical one)")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip malformed trace lines (counted and reported) instead of stopping")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout, no progress bar")


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "replay", help="replay agent traces through a drafter: tau, acceptance, latency",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_trace_arguments(parser)
    parser.add_argument("--budget", type=_budget, default=32, metavar="B",
                        help="at most B draft tokens per step (default: 32)")
    parser.add_argument("--drafter", default=None, metavar="NAME",
                        help="a drafter by name (an unknown name lists the known ones) or 'oracle' "
                        "(default: 'reprise', the full proposer)")
    parser.add_argument("--chain", action="store_true",
                        help="one path per step (what a chain verifier such as vLLM's is sent), not a tree")
    parser.add_argument("--headroom", action="store_true",
                        help="with --chain: also the taus of better first-token choices (oracles) and of "
                        "the whole tree, per file")
    parser.add_argument("--lines", type=_line_range, default=None, metavar="FIRST-LAST",
                        help="replay only the calls of these lines of each file (1-based, inclusive), with "
                        "fresh histories: e.g. a file's later part, as a stand-in for unseen traffic")
    parser.add_argument("--held-out", type=_share, default=None, metavar="F",
                        help="replay only the share F of sessions that `reprise train-drafter --held-out F` "
                        "holds out (a seeded hash of the session id), with fresh histories")
    add_fleet_arguments(parser)
    parser.set_defaults(func=run)


def _line_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    try:
        lines = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST (line numbers), got {text!r}") from None
    if not 1 <= lines[0] <= lines[1]:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST with 1 <= FIRST <= LAST, got {text!r}")
    return lines


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}")
    return value


def check_traces(paths: list[str]) -> list[Path]:
    """The trace paths as Paths; a missing or unreadable one is a CliError naming it."""
    out = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise CliError(f"no such trace file: {p}")
        if not path.is_file():
            raise CliError(f"not a file: {p}")
        out.append(path)
    return out


def make_tokenizer(name: str):
    try:
        return CanonicalTokenizer(name)
    except ValueError as exc:
        raise CliError(str(exc)) from None


class Progress:
    """A tqdm bar over calls on stderr, only when stderr is a terminal and output is not JSON."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._bar = None

    def start(self, desc: str, total: int | None, unit: str = "call") -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)

    def on_call(self, call, num_tokens: int) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def replay_one(path: Path, drafter: str, *, tokenizer, budget: int, max_calls: int | None,
               skip_bad_lines: bool, progress: Progress, config=None, chain: bool = False,
               headroom: ChainHeadroom | None = None, lines: tuple[int, int] | None = None,
               held_out: float | None = None):
    """Replay one file with the named proposer (or the oracle), as trees or with ``chain`` as single
    paths (``retrieval.chain.ChainProposer``), ``headroom`` observing each chain step; ``lines`` and
    ``held_out`` select calls (``read_calls``); trace errors become CliError."""
    from reprise.drafters import make_chain_proposer, make_proposer

    stats = TraceStats()
    calls: Iterable[Call]
    proposer: Proposer
    try:
        calls = read_calls(path, max_calls=max_calls, skip_bad_lines=skip_bad_lines, stats=stats, lines=lines,
                           held_out=held_out)
        if drafter == ORACLE:
            listed = list(calls)
            progress.note(f"{path.name}: building the copy-limit oracle over {len(listed)} calls")
            proposer = CopyLimitOracle(listed, tokenizer, max_len=budget)
            calls = listed
        else:
            proposer = (make_chain_proposer if chain else make_proposer)(drafter, config)
        progress.start(path.name, max_calls)
        return replay_calls(calls, proposer, tokenizer, budget=budget, drafter=drafter, path=str(path),
                            stats=stats, on_call=progress.on_call,
                            on_step=headroom.observe if headroom is not None else None)
    except (ValueError, OSError, EOFError) as exc:
        raise CliError(str(exc)) from None
    finally:
        progress.close()


def report_skipped(reports, command: str) -> None:
    """Tell stderr how many bad lines --skip-bad-lines skipped, and the first few of them."""
    for r in reports:
        if r.skipped_lines:
            print(f"reprise {command}: {r.path}: skipped {r.skipped_lines} bad lines", file=sys.stderr)
            for message in r.skipped_examples:
                print(f"  {message}", file=sys.stderr)


def format_table(reports, budget: int) -> str:
    """The human table: one row per file, then acceptance by draft position."""
    header = ("file", "calls", "tokens", "steps", "tau", "draft/step", "accept", "hit", "spec p50 us",
              "spec p99 us")
    rows = [header]
    for r in reports:
        rows.append((Path(r.path).name, f"{r.calls}", f"{r.tokens}", f"{r.steps}", f"{r.tau:.3f}",
                     f"{r.draft_tokens_per_step:.2f}", f"{r.acceptance_rate:.3f}", f"{r.hit_rate:.3f}",
                     f"{r.speculate_us_p50:.1f}", f"{r.speculate_us_p99:.1f}"))
    lines = [columns(rows)]
    shown = [k for k in _SHOWN_POSITIONS if k <= budget]
    if shown:
        lines.append("")
        lines.append("acceptance by draft position k (steps accepting >= k draft tokens / steps with a draft):")
        pos_rows = [("file", *[f"k={k}" for k in shown])]
        for r in reports:
            pos_rows.append((Path(r.path).name, *[f"{r.acceptance_by_position[k - 1]:.3f}" for k in shown]))
        lines.append(columns(pos_rows))
    return "\n".join(lines)


def format_headroom(reports, headrooms: list[ChainHeadroom]) -> str:
    """The --headroom table: one row per file, tau of each first-token choice (replay_traces/headroom.py)."""
    rows: list[tuple[str, ...]] = [("file", *FIGURES)]
    for r, h in zip(reports, headrooms):
        taus = h.taus()
        rows.append((Path(r.path).name, *[f"{taus[name]:.3f}" for name in FIGURES]))
    return ("\nheadroom: tau had each step's chain started at the better of the tree's 2 / 4 best roots, at the "
            "right root, or had the whole tree been verified:\n" + columns(rows))


def run(args: argparse.Namespace) -> int:
    from reprise.drafters import DEFAULT_DRAFTER, proposer_names

    paths = check_traces(args.traces)
    drafter = args.drafter or DEFAULT_DRAFTER
    if drafter != ORACLE and drafter not in proposer_names():
        raise CliError(f"unknown drafter {drafter!r}; known: {', '.join(proposer_names() + [ORACLE])}")
    if args.headroom and not args.chain:
        raise CliError("--headroom measures chains: add --chain")
    if args.headroom and drafter == ORACLE:
        raise CliError("--headroom needs a drafter's trees; the oracle proposes one copy, not a tree")
    fleet = fleet_requested(args)
    tokenizer = make_tokenizer(args.tokenizer)
    config = DraftingConfig(max_draft_tokens=args.budget)
    progress = Progress(enabled=not args.json)
    if fleet:
        return run_fleet(args, paths, drafter, tokenizer, config, progress)
    reports = []
    headrooms: list[ChainHeadroom] = []
    for path in paths:
        headroom = ChainHeadroom(args.budget) if args.headroom else None
        try:
            reports.append(replay_one(path, drafter, tokenizer=tokenizer, budget=args.budget,
                                      max_calls=args.max_calls, skip_bad_lines=args.skip_bad_lines,
                                      progress=progress, config=config, chain=args.chain, headroom=headroom,
                                      lines=args.lines, held_out=args.held_out))
        except CliError:
            if reports and not args.json:  # keep the files already replayed
                print(format_table(reports, args.budget))
            raise
        if headroom is not None:
            headrooms.append(headroom)
    report_skipped(reports, "replay")
    if args.json:
        json.dump({"drafter": drafter, "budget": args.budget, "chain": args.chain, "tokenizer": args.tokenizer,
                   "files": [_file_dict(r, headrooms[i] if headrooms else None) for i, r in enumerate(reports)]},
                  sys.stdout, indent=2)
        print()
    else:
        shape = "one path per step" if args.chain else "trees"
        print(f"drafter {drafter}, budget {args.budget} ({shape}), tokenizer {args.tokenizer}")
        print(format_table(reports, args.budget))
        if headrooms:
            print(format_headroom(reports, headrooms))
    return 0


def _file_dict(report, headroom: ChainHeadroom | None) -> dict:
    d = report.to_dict()
    if headroom is not None:
        d["headroom"] = headroom.taus()
    return d
