"""The batches a plain engine would have decoded the same requests in: the decode side of the savings
estimate (serving/savings.py) where requests share steps.

Pricing each token at the plain step of the batch it was decoded in with drafts holds the batch fixed.
A plain engine batches the same requests differently: a request that drafts well finishes early with
drafts but late without, so without drafts the long requests spend their last steps in smaller batches,
where a step is dearest per token. ``PlainSchedule`` replays the requests through a plain engine
instead, step by step, one token per request per step, each step priced at the engine's plain step of
its batch size and context, and gives each request its share of the steps it was in.

When a request would have reached the plain engine, from what the drafted run shows:

- **the next call of an agent session** (tenant and session id, its previous call finished): as long
  after the previous call's plain end as it came after its drafted end (the agent's own time between
  calls held);
- **a request to an idle engine** (nothing in flight): after every earlier request's plain end, by the
  same gap (nothing was waiting, so what comes next may be the clients' answer to what finished);
- **any other request**: at the same offset from the start of its busy period as with drafts (traffic
  that arrives on its own).

At most ``max_batch`` requests run in a plain step (the engine's limit); the rest queue in arrival
order. A request's arrival is when the engine scheduled it; once admitted, its prefill keeps the plain
engine busy for as long as it took with drafts (prefill is priced apart, at its own time). The tokens
the drafted run decoded in steps that also prefilled are the caller's to split: a plain engine's step
would have carried one token a request too, at the same cost, so only the rest are this schedule's.

The schedule follows the drafted run as it goes: a plain step is taken only once every request in it
has a token the drafted run delivered (or has finished), so plain costs come out after the tokens they
price, and a request's come out together when its plain run ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

SESSIONS_KEPT = 4096  # agent sessions whose last call is remembered (least recently used go first)
MAX_RUNS = 16_384  # requests followed at once; past it the oldest finished go out at their own time
UNPRICED_HOLD_S = 120.0  # how long a finished request waits for a step cost before it goes out at its own time


@dataclass(slots=True)
class _Run:
    """One request as the schedule follows it. Times are seconds on the drafted run's clock (``arrived``,
    ``finished_at``) or the plain schedule's (``start``, ``end``), which starts at the same origin."""

    key: str
    tenant: str | None  # None: a request no tenant is accounted for (it still takes a place in a batch)
    arrived: float
    prefill: float = 0.0  # seconds its prefill kept the engine busy
    context: int = 0  # tokens in its context when its first token was out
    after: tuple[str, ...] = ()  # runs whose plain end this one waits for
    floor: float = 0.0  # plain end of earlier runs already gone from the schedule (a barrier's)
    origin: str | None = None  # the run starting its busy period (an arrival on its own)
    delay: float = 0.0  # seconds after what it waits for
    delivered: int = 0  # decoding tokens the drafted run delivered so far
    spent: float = 0.0  # their measured seconds
    last: float = 0.0  # when the drafted run delivered its last token so far
    finished_at: float | None = None
    start: float | None = None
    done: int = 0  # tokens decoded in plain steps
    plain: float = 0.0  # its share of those steps' seconds
    end: float | None = None


@dataclass(slots=True)
class PlainSchedule:
    """Requests replayed through a plain engine (module docstring). ``arrive`` when a request's first
    token is out, ``deliver`` its decoding tokens, ``finish`` when it ends; ``advance`` takes every plain
    step it can and returns ``(tenant, plain seconds, spent seconds)`` for each request whose plain run
    ended; ``flush`` gives up on pricing (no step cost) and returns the finished ones at their own time."""

    max_batch: int
    _runs: dict[str, _Run] = field(default_factory=dict)  # arrival order
    _ended: OrderedDict[str, tuple[float, float, float]] = field(default_factory=OrderedDict)  # (finished_at, start, end)
    _sessions: OrderedDict[tuple[str, str], str] = field(default_factory=OrderedDict)
    _floor: float = 0.0  # the latest plain end of a run gone from the schedule
    _last_finish: float = 0.0  # the latest drafted finish of any run
    _origin: str | None = None
    _active: list[str] = field(default_factory=list)  # in the plain engine's batch
    _waiting: list[str] = field(default_factory=list)  # not yet in it, in arrival order
    _clock: float | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")

    def __len__(self) -> int:
        return len(self._runs)

    def arrive(self, key: str, tenant: str | None, session: str, now: float, prefill_seconds: float = 0.0,
               context_tokens: int = 0) -> None:
        """Request ``key`` of ``tenant`` (agent ``session``, "" for none) reached the engine at ``now``, took
        ``prefill_seconds`` of prefill before its first token and has ``context_tokens`` of context with it
        (call it once that token is out)."""
        if key in self._runs:
            return
        run = _Run(key, tenant, now, prefill_seconds, context_tokens, last=now)
        previous = self._sessions.get((tenant, session)) if tenant is not None and session else None
        previous_end = self._finished_at(previous) if previous is not None else None
        idle = all(r.finished_at is not None and r.finished_at <= now for r in self._runs.values())
        if previous is not None and previous_end is not None:
            run.after, run.delay = (previous,), now - previous_end
        elif idle:
            run.after = tuple(self._runs)
            run.floor = self._floor
            run.delay = now - self._last_finish
        else:
            origin = self._origin if self._origin in self._runs else next(iter(self._runs))
            run.origin, run.delay = origin, now - self._runs[origin].arrived
        if idle:
            self._origin = key
        if tenant is not None and session:
            self._sessions[(tenant, session)] = key
            self._sessions.move_to_end((tenant, session))
            while len(self._sessions) > SESSIONS_KEPT:
                self._sessions.popitem(last=False)
        self._runs[key] = run
        self._waiting.append(key)

    def deliver(self, key: str, num_tokens: int, seconds: float, now: float) -> None:
        """The drafted run delivered ``num_tokens`` decoding tokens of ``key`` at ``now``, in ``seconds`` of
        its steps."""
        run = self._runs.get(key)
        if run is not None and run.finished_at is None:
            run.delivered += num_tokens
            run.spent += seconds
            run.last = now

    def finish(self, key: str) -> None:
        """Request ``key`` has ended: with its last delivered token (found out then, or later when it left
        the batch)."""
        run = self._runs.get(key)
        if run is not None and run.finished_at is None:
            run.finished_at = run.last
            self._last_finish = max(self._last_finish, run.last)

    def finish_all(self) -> None:
        """Every request in the schedule has ended (a benchmark's pass is over)."""
        for key in list(self._runs):
            self.finish(key)

    def advance(self, plain_step: Callable[[int, int], float | None]) -> list[tuple[str | None, float, float]]:
        """Take every plain step the drafted run has delivered the tokens for, each priced at
        ``plain_step(batch size, context tokens of the batch)`` (None: no price yet, so no step). Returns the
        runs whose plain run ended."""
        out: list[tuple[str | None, float, float]] = []
        while True:
            self._admit()
            complete = [r for r in (self._runs[k] for k in self._active)
                        if r.finished_at is not None and r.done >= r.delivered]
            if complete:  # its plain run ends with its last plain step (a slot frees: admit again)
                assert self._clock is not None
                out += [self._end(run, self._clock) for run in complete]
                continue
            if not self._active:
                starts = [s for s in (self._runs[k].start for k in self._waiting) if s is not None]
                if not starts:
                    return out
                self._clock = min(starts) if self._clock is None else max(self._clock, min(starts))
                self._admit()
                if not self._active:
                    return out
                continue
            active = [self._runs[k] for k in self._active]
            if any(r.done >= r.delivered for r in active):
                return out  # the drafted run has not delivered this step's tokens yet
            price = plain_step(len(active), sum(r.context + r.done for r in active))
            if price is None:
                return out
            assert self._clock is not None
            self._clock += price
            for run in active:
                run.done += 1
                run.plain += price / len(active)

    def price(self, plain_step: Callable[[int, int], float | None], now: float, hold_s: float = UNPRICED_HOLD_S,
              *, finished: bool = False) -> list[tuple[str | None, float, float]]:
        """What an engine calls after its steps: ``advance``; where there is no price at all yet, the runs
        that finished ``hold_s`` before ``now`` (``finished``: every finished run) at their own time
        (``flush``); and ``trim``. The runs whose plain run ended."""
        ended = self.advance(plain_step)
        if plain_step(1, 0) is None:
            ended += self.flush(float("inf") if finished else now - hold_s)
        return ended + self.trim()

    def flush(self, before: float, runs: list[_Run] | None = None) -> list[tuple[str | None, float, float]]:
        """Runs (``runs``, or all) that finished (drafted) before ``before`` and are still unpriced, at their
        own time: the engine has no plain step to price them with. Their plain end is taken as their
        drafted one."""
        out = []
        runs = list(self._runs.values()) if runs is None else runs
        for run in [r for r in runs if r.finished_at is not None and r.finished_at < before]:
            run.plain = run.spent
            out.append(self._end(run, max(run.finished_at or 0.0, self._clock or 0.0)))
        return out

    def trim(self) -> list[tuple[str | None, float, float]]:
        """The oldest finished runs, at their own time, while more than ``MAX_RUNS`` are followed (a plain
        schedule that stalls for good, or falls ever further behind, must not hold memory without bound)."""
        over = len(self._runs) - MAX_RUNS
        if over <= 0:
            return []
        oldest = [r for r in self._runs.values() if r.finished_at is not None][:over]
        return self.flush(before=float("inf"), runs=oldest)

    # ---- the schedule ------------------------------------------------------------------------------

    def _finished_at(self, key: str) -> float | None:
        if key in self._runs:
            return self._runs[key].finished_at
        ended = self._ended.get(key)
        return ended[0] if ended is not None else None

    def _start(self, key: str) -> float | None:
        if key in self._runs:
            return self._runs[key].start
        ended = self._ended.get(key)
        return ended[1] if ended is not None else self._clock  # forgotten long ago: started by now

    def _plain_end(self, key: str) -> float | None:
        if key in self._runs:
            return self._runs[key].end
        ended = self._ended.get(key)
        return ended[2] if ended is not None else self._floor  # forgotten long ago: ended by the floor

    def _resolve(self, run: _Run) -> None:
        """Set ``run.start`` once what it waits for has a plain time."""
        if run.origin is not None:  # on its own: the same offset into its busy period
            base = self._start(run.origin)
        elif run.after or run.floor:  # after a session's previous call, or after everything before
            ends = [self._plain_end(k) for k in run.after]
            base = None if any(e is None for e in ends) else max([run.floor] + [e for e in ends if e is not None])
        else:  # the first request of all: as it came
            run.start = run.arrived
            return
        if base is not None:
            run.start = base + run.delay

    def _admit(self) -> None:
        waiting = [self._runs[k] for k in self._waiting]
        for run in waiting:
            if run.start is None:
                self._resolve(run)
        while self._clock is not None and len(self._active) < self.max_batch:
            due = [r for r in waiting if r.start is not None and r.start <= self._clock and r.key in self._waiting]
            if not due:
                return
            run = min(due, key=lambda r: r.start or 0.0)  # the earliest; its prefill may make others due
            self._waiting.remove(run.key)
            self._active.append(run.key)
            self._clock += run.prefill  # its prefill keeps the engine busy (decoding alongside: as drafted)

    def _end(self, run: _Run, when: float) -> tuple[str | None, float, float]:
        run.end = when
        if run.key in self._active:
            self._active.remove(run.key)
        else:
            self._waiting.remove(run.key)
        del self._runs[run.key]
        self._floor = max(self._floor, when)
        self._ended[run.key] = (run.finished_at or when, run.start if run.start is not None else when, when)
        while len(self._ended) > SESSIONS_KEPT:
            self._ended.popitem(last=False)
        return run.tenant, run.plain, run.spent
