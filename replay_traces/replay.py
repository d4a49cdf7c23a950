"""The canonical replay (docs/replay.md): drafting simulated against recorded responses.

For every call of a file, in file order, through one fresh ``Proposer`` per file::

    s = proposer.begin(tenant, session, prompt_ids)
    while response tokens remain:
        tree = s.propose(budget)            # timed: the speculation latency of the step
        accept the longest root path of the tree that matches the next recorded tokens,
        then one bonus token (the target's own next token), never past the response end
        s.commit(Verified(accepted + bonus, accepted nodes))
    s.finish(record=True)                   # prompt and response join the tenant's history

When a draft matches every remaining token, the step emits just those: the bonus of that step would be
the end-of-sequence token, which the recorded response does not contain. ``tau`` = response tokens /
steps is therefore an upper bound on the speedup in target forward passes.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replay_traces.tokenizer import CanonicalTokenizer
from replay_traces.traces import Call, TraceStats, iter_calls
from retrieval.session import Proposer, Verified

DEFAULT_BUDGET = 32
_MAX_CHAIN_CHECK = 1025
_CHAINS = [list(range(-1, n - 1)) for n in range(_MAX_CHAIN_CHECK)]  # parents of an n-node chain


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """Figures of one replayed file (or of several pooled by ``pool_reports``).

    ``tau`` = response tokens / steps; ``draft_tokens_per_step`` = drafted nodes / steps;
    ``acceptance_rate`` = accepted draft tokens / drafted nodes; ``hit_rate`` = steps with a non-empty
    draft / steps; ``acceptance_by_position[k-1]`` = steps that accepted at least k draft tokens /
    steps with a non-empty draft (k = 1 .. budget); ``speculate_us_*`` = percentiles of the time one
    ``propose`` call took.
    """

    path: str
    drafter: str
    budget: int
    calls: int
    tokens: int
    steps: int
    draft_tokens: int
    accepted_tokens: int
    hit_steps: int
    prompt_tokens: int
    tau: float
    draft_tokens_per_step: float
    acceptance_rate: float
    hit_rate: float
    speculate_us_p50: float
    speculate_us_p99: float
    acceptance_by_position: tuple[float, ...]
    wall_s: float
    skipped_lines: int = 0
    skipped_empty_responses: int = 0
    skipped_examples: tuple[str, ...] = ()  # the first few "file:line: what" of the skipped lines

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_by_position"] = list(self.acceptance_by_position)
        d["skipped_examples"] = list(self.skipped_examples)
        return d


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def _by_position(accepted_on_hits: np.ndarray, budget: int) -> tuple[float, ...]:
    """[k-1] -> fraction of non-empty-draft steps that accepted >= k draft tokens, k = 1..budget."""
    if budget <= 0:
        return ()
    hits = len(accepted_on_hits)
    if hits == 0:
        return (0.0,) * budget
    counts = np.bincount(np.minimum(accepted_on_hits, budget), minlength=budget + 1)
    at_least = np.cumsum(counts[::-1])[::-1]  # at_least[k] = steps accepting >= k
    return tuple(float(x) for x in at_least[1 : budget + 1] / hits)


class StepTally:
    """Per-step counters of one replay; turned into a ``ReplayReport`` at the end."""

    def __init__(self) -> None:
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.spec_ns: list[int] = []
        self.calls = 0
        self.tokens = 0
        self.prompt_tokens = 0

    @classmethod
    def merged(cls, tallies: Iterable[StepTally]) -> StepTally:
        """One tally holding every step and call of ``tallies``."""
        out = cls()
        for t in tallies:
            out.drafted += t.drafted
            out.accepted += t.accepted
            out.spec_ns += t.spec_ns
            out.calls += t.calls
            out.tokens += t.tokens
            out.prompt_tokens += t.prompt_tokens
        return out

    def report(self, path: str, drafter: str, budget: int, wall_s: float, stats: TraceStats) -> ReplayReport:
        drafted = np.asarray(self.drafted, dtype=np.int64)
        accepted = np.asarray(self.accepted, dtype=np.int64)
        spec_us = np.asarray(self.spec_ns, dtype=np.float64) / 1e3
        steps = len(drafted)
        hit = drafted > 0
        p50, p99 = (np.percentile(spec_us, [50, 99]) if steps else (0.0, 0.0))
        return ReplayReport(
            path=path,
            drafter=drafter,
            budget=budget,
            calls=self.calls,
            tokens=self.tokens,
            steps=steps,
            draft_tokens=int(drafted.sum()),
            accepted_tokens=int(accepted.sum()),
            hit_steps=int(hit.sum()),
            prompt_tokens=self.prompt_tokens,
            tau=_ratio(self.tokens, steps),
            draft_tokens_per_step=_ratio(drafted.sum(), steps),
            acceptance_rate=_ratio(accepted.sum(), drafted.sum()),
            hit_rate=_ratio(hit.sum(), steps),
            speculate_us_p50=float(p50),
            speculate_us_p99=float(p99),
            acceptance_by_position=_by_position(accepted[hit], budget),
            wall_s=wall_s,
            skipped_lines=stats.skipped_lines,
            skipped_empty_responses=stats.skipped_empty_responses,
            skipped_examples=tuple(stats.errors[:5]),
        )


def accepted_path(token_ids: Sequence[int], parents: Sequence[int], target: list[int], pos: int) -> list[int]:
    """Greedy verification against the recorded response: the nodes (root to leaf) of the deepest tree
    node whose root path equals ``target[pos : pos + depth]`` (the first such node on ties). Raises
    ValueError when a parent does not precede its node.

    ``token_ids``/``parents`` are lists (one entry per node); ``target`` is the recorded response. A plain
    loop over at most ``budget`` nodes: for trees of tens of nodes it beats numpy's per-call overhead,
    and chains (the common case) stop at the first mismatch.
    """
    n = len(token_ids)
    limit = len(target) - pos
    if n < _MAX_CHAIN_CHECK and parents == _CHAINS[n]:
        # A chain (the common case): stop at the first mismatch.
        for d in range(min(n, limit)):
            if token_ids[d] != target[pos + d]:
                return list(range(d))
        return list(range(min(n, limit)))
    depth = [0] * n  # depth of node i when its whole root path matches, else 0
    best, deepest = 0, -1
    for i in range(n):
        p = parents[i]
        if p == -1:
            d = 1
        elif 0 <= p < i:
            d = depth[p]
            if not d:
                continue
            d += 1
        else:
            raise ValueError(f"draft tree node {i} has parent {p}: parents must be -1 or precede the node")
        if d <= limit and token_ids[i] == target[pos + d - 1]:
            depth[i] = d
            if d > best:
                best, deepest = d, i
    path = []
    while deepest >= 0:
        path.append(deepest)
        deepest = parents[deepest]
    return path[::-1]


@dataclass(frozen=True, slots=True)
class Lane:
    """One drafter of a replay pass (``replay_lanes``): every call is decoded through each lane's proposer
    in turn, so lanes share the reading and tokenising of the file. ``on_step(session, response, pos)``
    runs after each of this lane's proposals."""

    name: str
    proposer: Proposer
    on_step: Callable[[Any, list[int], int], None] | None = None


def replay_calls(
    calls: Iterable[Call],
    proposer: Proposer,
    tokenizer: CanonicalTokenizer,
    *,
    budget: int = DEFAULT_BUDGET,
    drafter: str = "",
    path: str = "",
    stats: TraceStats | None = None,
    on_call: Callable[[Call, int], None] | None = None,
    on_step: Callable[[Any, list[int], int], None] | None = None,
) -> ReplayReport:
    """Replay ``calls`` in order through ``proposer``; ``on_call(call, response_tokens)`` after each call,
    ``on_step(session, response, pos)`` after each proposal (before its tokens are committed)."""
    lane = Lane(drafter, proposer, on_step)
    return replay_lanes(calls, [lane], tokenizer, budget=budget, path=path, stats=stats, on_call=on_call)[0][""]


def replay_lanes(
    calls: Iterable[Call],
    lanes: Sequence[Lane],
    tokenizer: CanonicalTokenizer,
    *,
    budget: int = DEFAULT_BUDGET,
    path: str = "",
    stats: TraceStats | None = None,
    on_call: Callable[[Call, int], None] | None = None,
    group_of: Callable[[Call], str] | None = None,
) -> list[dict[str, ReplayReport]]:
    """Replay ``calls`` in one pass through every lane (each call: begin, decode, finish in lane order;
    the lanes' proposers share nothing, so each lane's figures are those of replaying it alone).

    Per lane, ``{"": report over all calls}``, plus one report per group when ``group_of(call)`` names
    groups (e.g. the source file of a mix). ``wall_s`` is the whole pass's."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    for lane in lanes:
        if hasattr(lane.proposer, "set_vocabulary"):  # canonical matching needs the tokenizer's number tokens
            lane.proposer.set_vocabulary(tokenizer.decode_token, tokenizer.vocab_size)
    tallies: list[dict[str, StepTally]] = [{} for _ in lanes]
    started = time.perf_counter()
    for call in calls:
        prompt = tokenizer.prompt_ids(call.messages)
        response = tokenizer.response_ids(call.response)
        group = group_of(call) if group_of is not None else ""
        for lane, lane_tallies in zip(lanes, tallies):
            tally = lane_tallies.get(group)
            if tally is None:
                tally = lane_tallies[group] = StepTally()
            session = lane.proposer.begin(call.tenant, call.session, prompt, str(call.index))
            where = f"{call.path}:{call.line_no}: drafter {lane.name or type(lane.proposer).__name__!r}"
            decode_response(session, response, budget, tally, where, lane.on_step)
            session.finish(record=True)
            tally.calls += 1
            tally.tokens += len(response)
            tally.prompt_tokens += len(prompt)
        if on_call is not None:
            on_call(call, len(response))
    wall_s = time.perf_counter() - started
    stats = stats if stats is not None else TraceStats()
    out = []
    for lane, lane_tallies in zip(lanes, tallies):
        reports = {g: t.report(path, lane.name, budget, wall_s, stats) for g, t in lane_tallies.items()}
        if group_of is not None or not lane_tallies:
            reports[""] = StepTally.merged(lane_tallies.values()).report(path, lane.name, budget, wall_s, stats)
        out.append(reports)
    return out


def decode_response(session: Any, response: np.ndarray, budget: int, tally: StepTally, where: str = "",
                    on_step: Callable[[Any, list[int], int], None] | None = None) -> None:
    """Decode one recorded response (token ids) through a drafting session: each step the session
    proposes at most ``budget`` nodes, greedy verification accepts the deepest matching root path and one
    bonus token, and the session is told what was committed. Each step's counts go to ``tally``;
    ``on_step(session, response, pos)`` runs after each proposal; ValueError (prefixed with ``where``)
    for a tree over the budget or with bad parents."""
    target = response.tolist()
    num_tokens = len(target)
    drafted, accepted, spec_ns = tally.drafted, tally.accepted, tally.spec_ns
    clock = time.perf_counter_ns
    pos = 0
    while pos < num_tokens:
        t0 = clock()
        tree = session.propose(budget)
        t1 = clock()
        n = len(tree.token_ids)
        if n:
            if n > budget:
                raise ValueError(f"{where} proposed {n} nodes with a budget of {budget}")
            parents = tree.parents.tolist()
            if len(parents) != n:
                raise ValueError(f"{where}: draft tree has {n} tokens but {len(parents)} parents")
            try:
                nodes = accepted_path(tree.token_ids.tolist(), parents, target, pos)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        else:
            nodes = []
        if on_step is not None:
            on_step(session, target, pos)
        a = len(nodes)
        end = pos + a + 1 if pos + a < num_tokens else num_tokens
        session.commit(Verified(response[pos:end], np.asarray(nodes, dtype=np.int32), n > 0))
        drafted.append(n)
        accepted.append(a)
        spec_ns.append(t1 - t0)
        pos = end


def read_calls(path: str | Path, *, max_calls: int | None = None, skip_bad_lines: bool = False,
               stats: TraceStats | None = None, lines: tuple[int, int] | None = None,
               held_out: float | None = None) -> Iterable[Call]:
    """The first ``max_calls`` calls of a file (all when None), lazily; with ``lines`` (first, last),
    1-based and inclusive, only the calls of those lines; with ``held_out`` only the sessions of that
    share picked by ``session_share`` (the split ``reprise train-drafter --held-out`` holds out)."""
    if max_calls is not None and max_calls < 0:
        raise ValueError(f"max_calls must be >= 0, got {max_calls}")
    if lines is not None and not 1 <= lines[0] <= lines[1]:
        raise ValueError(f"lines must be FIRST-LAST with 1 <= FIRST <= LAST, got {lines[0]}-{lines[1]}")
    if held_out is not None and not 0.0 < held_out <= 1.0:
        raise ValueError(f"held_out must be in (0, 1], got {held_out}")
    calls: Iterable[Call] = iter_calls(path, skip_bad_lines=skip_bad_lines, stats=stats)
    if lines is not None:
        first, last = lines
        calls = itertools.takewhile(lambda c: c.line_no <= last, (c for c in calls if c.line_no >= first))
    if held_out is not None:
        share = held_out
        calls = (c for c in calls if session_share(c.session) < share)
    return calls if max_calls is None else itertools.islice(calls, max_calls)


def session_share(session: str, seed: int = 0) -> float:
    """Where a session falls in [0, 1), by a seeded hash of its id: the sessions below a share are that
    share of the sessions, the same ones whatever the file's order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{session}".encode()).digest()[:8], "big") / 2**64


def replay_file(
    path: str | Path,
    proposer_factory: Callable[[], Proposer],
    *,
    tokenizer: CanonicalTokenizer,
    budget: int = DEFAULT_BUDGET,
    max_calls: int | None = None,
    skip_bad_lines: bool = False,
    drafter: str = "",
    on_call: Callable[[Call, int], None] | None = None,
) -> ReplayReport:
    """Replay one trace file through a fresh proposer (no history carried between files)."""
    stats = TraceStats()
    calls = read_calls(path, max_calls=max_calls, skip_bad_lines=skip_bad_lines, stats=stats)
    return replay_calls(
        calls, proposer_factory(), tokenizer, budget=budget, drafter=drafter, path=str(path),
        stats=stats, on_call=on_call,
    )


def pool_reports(reports: Sequence[ReplayReport], path: str = "(all)") -> ReplayReport:
    """One report over several files: ratios of the summed counters; acceptance by position weighted
    by each file's non-empty-draft steps; latency percentiles are the worst file's (not re-pooled)."""
    if not reports:
        raise ValueError("no reports to pool")
    steps = sum(r.steps for r in reports)
    tokens = sum(r.tokens for r in reports)
    drafted = sum(r.draft_tokens for r in reports)
    accepted = sum(r.accepted_tokens for r in reports)
    hits = sum(r.hit_steps for r in reports)
    budget = max(r.budget for r in reports)
    by_pos = np.zeros(budget)
    for r in reports:
        by_pos[: len(r.acceptance_by_position)] += np.asarray(r.acceptance_by_position) * r.hit_steps
    return ReplayReport(
        path=path,
        drafter=reports[0].drafter,
        budget=budget,
        calls=sum(r.calls for r in reports),
        tokens=tokens,
        steps=steps,
        draft_tokens=drafted,
        accepted_tokens=accepted,
        hit_steps=hits,
        prompt_tokens=sum(r.prompt_tokens for r in reports),
        tau=_ratio(tokens, steps),
        draft_tokens_per_step=_ratio(drafted, steps),
        acceptance_rate=_ratio(accepted, drafted),
        hit_rate=_ratio(hits, steps),
        speculate_us_p50=max(r.speculate_us_p50 for r in reports),
        speculate_us_p99=max(r.speculate_us_p99 for r in reports),
        acceptance_by_position=tuple(float(x) for x in (by_pos / hits if hits else by_pos)),
        wall_s=sum(r.wall_s for r in reports),
        skipped_lines=sum(r.skipped_lines for r in reports),
        skipped_empty_responses=sum(r.skipped_empty_responses for r in reports),
        skipped_examples=tuple(m for r in reports for m in r.skipped_examples)[:5],
    )
