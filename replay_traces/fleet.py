"""A fleet of drafting replicas in replay (``reprise replay --replicas``): what a speculation memory shared
by every replica is worth against one tree per replica.

An operator who runs N vLLM replicas behind a load balancer with vLLM's suffix decoding gets one
in-memory tree per replica: every tenant's outputs mixed (``GlobalScope``), only the calls routed to it,
emptied when it restarts (``Fleet``). Reprise keeps each tenant's history in a store that every replica
reads and a restart does not lose, so its drafts are those of one proposer that sees every finished call
of the tenant: the plain replay's.

Both are replayed in one pass over a file (``replay_traces.replay.replay_lanes``): the shared proposer
once, and per fleet size and routing policy one ``Fleet`` of suffix trees; each call is decoded by the
shared proposer and by the replica its router picks in each fleet.

    routing "rr"       call k goes to replica k mod N (a session's calls land on different replicas)
    routing "sticky"   a call goes to replica hash(tenant, session) mod N (a session stays on one)
    restart_every K    before calls K, 2K, 3K, ... replicas 0, 1, 2, ... (in turn, mod N) restart empty
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from replay_traces.replay import Lane, replay_lanes
from replay_traces.traces import Call
from retrieval.session import DraftSession, Proposer

ROUTINGS = ("rr", "sticky")

#: The tenant every call of a ``GlobalScope`` drafts and records under.
EVERYONE = "*"


def route(routing: str, call_number: int, tenant: str, session: str, replicas: int) -> int:
    """The replica (0 .. replicas - 1) that serves the ``call_number``-th call (from 0, in trace order)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if routing == "rr":
        return call_number % replicas
    if routing == "sticky":
        digest = hashlib.blake2b(f"{tenant}\0{session}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % replicas
    raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")


class GlobalScope:
    """A proposer whose calls all draft from and record into one state, whatever their tenant: an
    engine-wide cache such as vLLM's suffix tree (no tenant or cache salt reaches it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def begin(self, tenant: str, session_id: str, prompt_ids: Any, request_id: str = "") -> DraftSession:
        return self.inner.begin(EVERYONE, session_id, prompt_ids, request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Fleet:
    """``replicas`` proposers made by ``make_replica()`` behind a router (see the module docstring).

    ``calls_per_replica`` counts the calls each replica served; ``restarts`` how many restarts happened.
    """

    def __init__(self, make_replica: Callable[[], Proposer], replicas: int, routing: str = "rr",
                 restart_every: int | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")
        if restart_every is not None and restart_every < 1:
            raise ValueError(f"restart_every must be >= 1, got {restart_every}")
        self.routing = routing
        self.restart_every = restart_every
        self._make = make_replica
        self._vocabulary: tuple[Any, ...] | None = None
        self.replicas = [make_replica() for _ in range(replicas)]
        self.calls_per_replica = [0] * replicas
        self.restarts = 0
        self._calls = 0

    def set_vocabulary(self, decode: Callable[[int], str], vocab_size: int) -> None:
        """Passed on to every replica that takes one, and to those that restart later."""
        self._vocabulary = (decode, vocab_size)
        for replica in self.replicas:
            self._teach(replica)

    def _teach(self, replica: Any) -> None:
        if self._vocabulary is not None and hasattr(replica, "set_vocabulary"):
            replica.set_vocabulary(*self._vocabulary)

    def begin(self, tenant: str, session_id: str, prompt_ids: Any, request_id: str = "") -> DraftSession:
        number = self._calls
        self._calls += 1
        if self.restart_every is not None and number and number % self.restart_every == 0:
            which = (number // self.restart_every - 1) % len(self.replicas)
            self.replicas[which] = self._make()  # a restart: the replica's memory is gone
            self._teach(self.replicas[which])
            self.restarts += 1
        r = route(self.routing, number, tenant, session_id, len(self.replicas))
        self.calls_per_replica[r] += 1
        return self.replicas[r].begin(tenant, session_id, prompt_ids, request_id)


def trace_name(path: str | Path) -> str:
    """A trace file's name without ``.gz`` and ``.jsonl``/``.json``: ``tau_airline.jsonl.gz`` ->
    ``tau_airline``."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def interleave(streams: Sequence[Iterable[Call]], seed: int = 0) -> Iterator[Call]:
    """The calls of several traces as one (``--mix``): each trace's calls in their order, the traces
    merged at random (the next call comes from a trace with a chance in proportion to the calls it has
    left, seeded: every merge order equally likely, the same one each run), so the traces run side by
    side to the end and no trace arrives with a fixed period that round-robin routing would alias with.
    Each call's tenant is prefixed by its file's name (a file is its own tenant; a file with several
    tenants keeps them apart) and its index renumbered."""
    lists = [list(s) for s in streams]
    left = [len(calls) for calls in lists]
    taken = [0] * len(lists)
    pick = random.Random(seed)
    for number in range(sum(left)):
        i = pick.choices(range(len(lists)), weights=left)[0]
        call = lists[i][taken[i]]
        taken[i] += 1
        left[i] -= 1
        yield dataclasses.replace(call, tenant=f"{trace_name(call.path)}:{call.tenant}", index=number)


#: The lanes every fleet replay has besides the shared proposer's (their keys in the figures).
PER_REPLICA = "suffixdecoding"  # one tree per replica, every tenant mixed, emptied on restart
SHARED_TREE = "suffixdecoding_shared"  # the same drafter per tenant, shared by every replica, never emptied


@dataclasses.dataclass(frozen=True, slots=True)
class FleetSpec:
    """The fleets to replay: every size in ``replicas`` under every policy in ``routings``."""

    replicas: tuple[int, ...]
    routings: tuple[str, ...] = ("rr",)
    restart_every: int | None = None

    def __post_init__(self) -> None:
        if not self.replicas or min(self.replicas) < 1:
            raise ValueError(f"replicas must be sizes >= 1, got {list(self.replicas)}")
        for r in self.routings:
            if r not in ROUTINGS:
                raise ValueError(f"unknown routing {r!r}; known: {', '.join(ROUTINGS)}")
        if not self.routings:
            raise ValueError("at least one routing is needed")
        if self.restart_every is not None and self.restart_every < 1:
            raise ValueError(f"restart_every must be >= 1, got {self.restart_every}")


def replay_fleet(calls: Iterable[Call], spec: FleetSpec, *, shared_name: str, make_shared: Callable[[], Proposer],
                 make_tree: Callable[[], Proposer], tokenizer: Any, budget: int, path: str = "",
                 stats: Any = None, on_call: Callable[[Call, int], None] | None = None,
                 mix: bool = False) -> dict[str, Any]:
    """Replay ``calls`` once through the shared proposer (``make_shared()``, named ``shared_name``), the
    per-tenant shared tree (``make_tree()``) and, per size and routing of ``spec``, a ``Fleet`` of
    ``GlobalScope(make_tree())`` replicas; returns the figures as a JSON-able dict (``"replicas"``: per
    size, the first routing's; ``"routings"``: every routing's, when several; ``"lanes"``: every lane's
    whole report). With ``mix`` (calls of several files, ``interleave``) it adds per file figures
    (``"groups"``) and what tenant scoping is worth (``"scoping"``: each drafter per tenant against one
    state for everyone, one replica, no restart)."""
    if shared_name in (PER_REPLICA, SHARED_TREE):
        raise ValueError(f"the shared drafter may not be called {shared_name!r}: that name is a fleet lane's")
    lanes = [Lane(shared_name, make_shared()), Lane(SHARED_TREE, make_tree())]
    fleets: dict[tuple[str, int], Fleet] = {}
    for routing in spec.routings:
        for n in spec.replicas:
            same = fleets.get((spec.routings[0], 1)) if n == 1 else None  # one replica: routing is moot
            if same is None:
                fleet = Fleet(lambda: GlobalScope(make_tree()), n, routing, spec.restart_every)
                lanes.append(Lane(f"{PER_REPLICA}/{routing}/{n}", fleet))
                same = fleet
            fleets[(routing, n)] = same
    if mix:
        lanes.append(Lane(f"{shared_name}_global", GlobalScope(make_shared())))
        lanes.append(Lane(f"{PER_REPLICA}_global", GlobalScope(make_tree())))
    group_of = (lambda call: trace_name(call.path)) if mix else None
    reports = replay_lanes(calls, lanes, tokenizer, budget=budget, path=path, stats=stats, on_call=on_call,
                           group_of=group_of)
    by_lane = dict(zip((lane.name for lane in lanes), reports))
    lane_of = {id(lane.proposer): lane.name for lane in lanes}

    def sizes(group: str, routing: str) -> dict[str, Any]:
        out = {}
        for n in spec.replicas:
            fleet = fleets[(routing, n)]
            out[str(n)] = _entry(by_lane, group, shared_name, lane_of[id(fleet)], routing, fleet)
        return out

    result: dict[str, Any] = {
        "path": path,
        "calls": by_lane[shared_name][""].calls,
        "tokens": by_lane[shared_name][""].tokens,
        "replicas": sizes("", spec.routings[0]),
    }
    if len(spec.routings) > 1:
        result["routings"] = {r: {"replicas": sizes("", r)} for r in spec.routings}
    if mix:
        groups = sorted(g for g in by_lane[shared_name] if g)
        result["groups"] = {g: {"calls": by_lane[shared_name][g].calls, "replicas": sizes(g, spec.routings[0]),
                                "scoping": _scoping(by_lane, g, shared_name)} for g in groups}
        result["scoping"] = _scoping(by_lane, "", shared_name)
    result["lanes"] = {name: reports[""].to_dict() for name, reports in by_lane.items()}
    return result


_FIGURES = ("tau", "acceptance_rate", "draft_tokens_per_step", "hit_rate")


def _entry(by_lane: dict[str, dict[str, Any]], group: str, shared: str, fleet_lane: str, routing: str,
           fleet: Fleet) -> dict[str, Any]:
    """One fleet size's figures: each figure of the shared proposer, the per-replica trees and the shared
    tree, and the shared proposer's tau over the per-replica trees' (``ratio``)."""
    reports = {shared: by_lane[shared][group], PER_REPLICA: by_lane[fleet_lane][group],
               SHARED_TREE: by_lane[SHARED_TREE][group]}
    out: dict[str, Any] = {name: {k: getattr(r, name) for k, r in reports.items()} for name in _FIGURES}
    per_replica = reports[PER_REPLICA].tau
    out["ratio"] = reports[shared].tau / per_replica if per_replica else 0.0
    out["routing"] = routing
    out["restarts"] = fleet.restarts
    out["calls_per_replica"] = list(fleet.calls_per_replica)
    return out


def _scoping(by_lane: dict[str, dict[str, Any]], group: str, shared: str) -> dict[str, dict[str, float]]:
    """Each drafter's tau drafting per tenant and from one state for everyone (one replica)."""
    return {shared: {"per_tenant": by_lane[shared][group].tau, "global": by_lane[f"{shared}_global"][group].tau},
            PER_REPLICA: {"per_tenant": by_lane[SHARED_TREE][group].tau,
                          "global": by_lane[f"{PER_REPLICA}_global"][group].tau}}
