"""Reprise's own decoding engine: every step verifies all active requests' draft trees in one pass.

    engine = Engine(ModelRunner(model, num_slots=8), make_proposer("reprise"), tokenizer)
    result = engine.generate(prompt_ids, max_new_tokens=128)            # one request, this thread
    handle = engine.submit(request, on_stream=print); engine.run_until_idle()   # many, packed

A request is the serving core's record (``serving.records.Request``: ``Request.of_tokens`` makes one
from token ids); what the engine keeps of it while it decodes (its slot, session, stop checker, grammar
state, the runner's sampling parameters) is its own (``_Active``) and never leaves it.

``Engine.step()`` is admit -> propose -> verify -> postprocess (docs/architecture.md draws it):

1. **admit**: waiting requests take free slots (their prompt is prefilled), the tenant holding the fewest
   slots first; while every slot is taken and another tenant waits, the tenant holding the most yields
   one: its newest request is parked whole and resumes later (reprise/engine/fair_share.py); cancelled
   requests leave;
2. **propose**: each request's drafting session proposes a tree; the draft budget keeps the nodes worth
   verifying (reprise/engine/draft_budget.py);
3. **verify**: one packed forward pass over every request's tree; the runner's acceptance decides the
   accepted path and the bonus token (verifier/runner.py);
4. **postprocess**: stop conditions cut the committed tokens (reprise/engine/stopping.py); each
   session is handed the step's ``Verified`` once, the stream gets the kept tokens; finished requests
   are resolved and, when recorded, go to the history sink;
5. **observe**: the observer gets one report per request: its counts, its share of the step's
   measured time, and what its tokens would have cost in plain steps of the same batch size on the
   engine's fitted step cost (serving/savings.py).

The accepted count is the runner's, cut only by stop conditions; everyone downstream (sessions, the
budget's tracker, usage, metering) reads that one value. A drafter that fails yields an empty draft
(the step still commits one token). Any other failure that belongs to one request (its grammar, stop
checks, stream callback, its part of verification) ends that request alone with ``error``; the step
goes on for the others, and nothing a request carries can stop the engine thread.
``submit`` and ``cancel`` are thread-safe; ``step`` runs on one thread (the engine's owner).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from reprise.engine import fair_share
from reprise.engine.draft_budget import AcceptanceTracker, DraftBudget
from reprise.engine.drafting import GuardedSession
from reprise.engine.grammar import GrammarState
from reprise.engine.grammar_compiler import CheckedGrammar, GrammarError
from reprise.engine.prefill_cost import PrefillCostFit
from reprise.engine.request import GenerationResult
from reprise.engine.step_cost import StepCostFit
from reprise.engine.stopping import StopChecker, check_stopping
from retrieval.draft_tree import DraftTree, subtree
from retrieval.session import Proposer, Verified
from serving.records import FinishReason, Request, Usage
from serving.savings import RequestCost, attribute_prefill, attribute_step
from verifier.runner import ModelRunner, ParkedRequest, VerifyResult, VerifyStep
from verifier.sampling import SamplingParams

log = logging.getLogger(__name__)

StreamCallback = Callable[[list[int], str], None]  # (committed token ids, text delta)


class StoreTicket(Protocol):
    """What a history sink hands back for a turn it will store: ``wait`` until it is stored (``ok``) or
    given up (``error`` says why)."""

    ok: bool
    error: str

    def wait(self, timeout: float | None = None) -> bool: ...


HistorySink = Callable[[GenerationResult], "StoreTicket | None"]  # a finished turn to record


@dataclass(frozen=True, slots=True)
class StepReport:
    """One request's part of a step, for metering: ``num_draft`` nodes verified, ``num_accepted`` of
    them accepted (the runner's count, cut by stop conditions), the draft's ``source`` and
    ``match_len``, the drafting session's ``propose_seconds`` (None when it did not propose: no room, or
    no speculation); ``speculated`` False for a request that asked for no speculation. ``num_tokens``
    committed; ``cost``: the request's share of the step's time against its tokens' plain steps;
    ``prefill``: its prefill's, on the request's first step (serving/savings.py)."""

    tenant: str
    num_draft: int
    num_accepted: int
    source: str
    match_len: int
    propose_seconds: float | None
    speculated: bool
    num_tokens: int = 0
    cost: RequestCost | None = None
    prefill: RequestCost | None = None


class StepObserver(Protocol):
    """Sees every step and every finished request (the service's metering)."""

    def on_step(self, reports: Sequence[StepReport]) -> None: ...

    def on_finish(self, result: GenerationResult) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings: the draft budget policy, EOS ids (default: the model's), the history sink (called
    with every finished turn that is recorded), the step observer, and whether a finished session
    records its turn into the proposer's index (``index_turns``; off on a replica, where turns reach
    the index from the shared stream: reprise/cluster/)."""

    budget: DraftBudget = field(default_factory=DraftBudget)
    eos_token_ids: tuple[int, ...] | None = None
    history_sink: HistorySink | None = None
    observer: StepObserver | None = None
    index_turns: bool = True


class RequestHandle:
    """A submitted request: ``wait()`` for its result, ``cancel()`` it from any thread. ``stored``: the
    history sink's ticket for a recorded turn (None when nothing is stored), for callers that answer
    only once the turn is durable."""

    def __init__(self, request: Request, cancel: threading.Event | None,
                 on_done: Callable[[RequestHandle], None] | None = None,
                 grammar: CheckedGrammar | None = None) -> None:
        self.request = request
        self.grammar = grammar  # the grammar its output follows (None: free)
        self.request_id = request.request_id
        self.cancelled = cancel if cancel is not None else threading.Event()
        self.done = threading.Event()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.stored: StoreTicket | None = None
        self._on_done = on_done

    def cancel(self) -> None:
        self.cancelled.set()

    def resolve(self, result: GenerationResult | None = None, error: BaseException | None = None) -> None:
        """Finish the handle (engine thread) and tell ``on_done``, the submitter's callback."""
        if result is not None:
            self.result = result
        if error is not None:
            self.error = error
        self.done.set()
        if self._on_done is not None:
            try:
                self._on_done(self)
            except Exception:  # a submitter that went away must not stop the engine
                log.exception("the completion callback of request %s failed", self.request_id)

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass(slots=True)
class _Active:
    """An admitted request's working state (internal)."""

    handle: RequestHandle
    slot: int
    session: GuardedSession
    stop: StopChecker
    on_stream: StreamCallback | None
    grammar: GrammarState | None = None  # the output's grammar at the committed tokens (reprise/engine/grammar.py)
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill: RequestCost | None = None  # the prefill's cost, until the first step's report carries it
    parked: ParkedRequest | None = None  # set while it has yielded its slot to another tenant (no slot)


@dataclass(slots=True)
class _Waiting:
    """A request waiting for a slot: a new one, or one that yielded its slot (``resumes``: its working
    state, kept whole: drafting session, stop checker, grammar, committed tokens)."""

    handle: RequestHandle
    on_stream: StreamCallback | None
    resumes: _Active | None = None


@dataclass(frozen=True, slots=True)
class _Draft:
    """One request's draft in a step: the tree verified (``keep``: its nodes' indices in the tree the
    session proposed, -1 for nodes a grammar forced), where it came from, what proposing it cost, and
    the grammar's token mask of its rows (None without a grammar)."""

    tree: DraftTree
    keep: np.ndarray
    match_len: int = 0
    propose_seconds: float | None = None
    token_mask: Any = None


@dataclass(slots=True)
class _NotStored:
    """The ticket of a turn the history sink failed to take: waiting on it says it was not stored."""

    error: str
    ok: bool = False

    def wait(self, timeout: float | None = None) -> bool:
        return True


class Engine:
    """Steps every active request together: one packed verification pass per step."""

    def __init__(self, runner: ModelRunner, proposer: Proposer, tokenizer: Any = None,
                 config: EngineConfig | None = None) -> None:
        self.runner = runner
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        eos = self.config.eos_token_ids
        if eos is None:
            model_eos = runner.model.generation_config.eos_token_id
            eos = () if model_eos is None else tuple(model_eos) if isinstance(model_eos, list) else (model_eos,)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        if getattr(proposer, "wants_hidden_states", False):
            runner.keep_hidden = True  # neural drafters read the target's states (Verified.hidden_states)
        self.step_costs = _step_costs(self.config.budget, runner)
        # One clock for every figure of the savings estimate: the step-cost fit's.
        self.clock = self.step_costs.clock if self.step_costs is not None else time.perf_counter
        self.prefill_costs = PrefillCostFit(self.clock)
        if runner.prefix_cache is not None:  # the price of a cached token, known before the first request
            self.prefill_costs.calibrate(runner)
        self._lock = threading.Lock()
        self._waiting: deque[_Waiting] = deque()
        self._active: list[_Active] = []
        self.preemptions = 0  # requests that yielded their slot to another tenant (fair share)

    def forget_tenant(self, tenant: str) -> int:
        """A deleted tenant: drop its cached KV (any thread); returns the blocks dropped."""
        cache = self.runner.prefix_cache
        return cache.drop(tenant) if cache is not None else 0

    # ---- submission (any thread) ------------------------------------------------------------------
    def submit(self, request: Request, *, grammar: CheckedGrammar | None = None,
               on_stream: StreamCallback | None = None, cancel: threading.Event | None = None,
               on_done: Callable[[RequestHandle], None] | None = None) -> RequestHandle:
        """Queue a request (its ``prompt_ids`` rendered, its ``max_new_tokens`` set); it is admitted at the
        next step with a free slot. ``grammar``: the grammar its output follows (``GrammarCompiler.compile``).
        ``on_done(handle)`` is called (on the engine thread) once it has its result or its error. What the
        engine cannot decode is refused here (ValueError)."""
        _check(request, self.tokenizer)
        if not request.request_id:
            request = replace(request, request_id=uuid.uuid4().hex)
        handle = RequestHandle(request, cancel, on_done, grammar)
        with self._lock:
            self._waiting.append(_Waiting(handle, on_stream))
        return handle

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._active)

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    def serve(self, stop: threading.Event, idle_wait_s: float = 0.01) -> None:
        """Step until ``stop`` is set (for a background thread; ``submit`` from others)."""
        while not stop.is_set():
            if not self.step():
                stop.wait(idle_wait_s)

    def generate(self, prompt_ids: Sequence[int], *, tenant: str = "default", on_stream: StreamCallback | None = None,
                 **params: Any) -> GenerationResult:
        """One request, decoded on this thread: ``params`` takes ``GenerateParams``' fields."""
        handle = self.submit(Request.of_tokens(prompt_ids, tenant=tenant, **params), on_stream=on_stream)
        while not handle.done.is_set():
            self.step()
        return handle.wait()

    # ---- one step (engine thread) -----------------------------------------------------------------
    def step(self) -> int:
        """Admit, propose, verify, postprocess. Returns how many requests were stepped.

        A failure that belongs to one request (its grammar, drafting, stop checks, stream callback, its
        part of verification) ends that request alone with ``error``, caught at the request's edge in
        each stage; the step goes on for the others."""
        batch = self._admit()
        if not batch:
            return 0
        started = self.clock()
        items, drafts = self._propose(batch)
        items, drafts, results = self._verify(items, drafts)
        if items:
            reports = self._postprocess(items, drafts, results)
            self._observe(reports, self.clock() - started)
        return len(batch)

    def _admit(self) -> list[_Active]:
        """Waiting requests into free slots (a new one prefills its prompt, a parked one resumes), a slot
        yielded to a waiting tenant where one holds more than its share; cancelled requests out. The
        step's batch."""
        while self._any_waiting():
            if not self.runner.num_free_slots and not self._yield_slot():
                break
            with self._lock:
                entry = self._next_waiting()
            self._take_slot(entry)
        for item in [a for a in self._active if a.handle.cancelled.is_set()]:
            self._finish(item, "aborted", None)
        return list(self._active)

    def _any_waiting(self) -> bool:
        with self._lock:
            return bool(self._waiting)

    def _held(self) -> dict[str, int]:
        """Slots held per tenant."""
        held: dict[str, int] = {}
        for item in self._active:
            held[item.handle.request.tenant] = held.get(item.handle.request.tenant, 0) + 1
        return held

    def _next_waiting(self) -> _Waiting:
        """The waiting request whose tenant holds the fewest slots (the oldest among equals), taken off
        the queue (under ``_lock``; ``fair_share.next_waiting``)."""
        best = fair_share.next_waiting(self._held(), [entry.handle.request.tenant for entry in self._waiting])
        entry = self._waiting[best]
        del self._waiting[best]
        return entry

    def _yield_slot(self) -> bool:
        """Every slot is taken: the tenant holding the most yields one when a waiting tenant holds at
        least two fewer (``fair_share.yielding_tenant``). Its newest request is parked (least work to
        redo) and waits ahead of the tenant's other waiting requests. Whether a slot is free now."""
        with self._lock:
            waiting = [entry.handle.request.tenant for entry in self._waiting if not entry.handle.cancelled.is_set()]
        tenant = fair_share.yielding_tenant(self._held(), waiting)
        if tenant is None:
            return False
        item = next(a for a in reversed(self._active) if a.handle.request.tenant == tenant)
        try:  # its committed rows go to the tenant's prefix cache where it may keep them (recomputed if not)
            item.parked = self.runner.park(item.slot, keep_cache=item.handle.request.params.record)
        except Exception as exc:  # noqa: BLE001 - this request's failure ends this request only
            self._fail(item, "yielding its slot", exc)
            return True
        self._active.remove(item)
        self.preemptions += 1
        with self._lock:
            self._waiting.appendleft(_Waiting(item.handle, item.on_stream, item))
        return True

    def _take_slot(self, entry: _Waiting) -> None:
        """``entry`` into a free slot: a new request starts, a parked one resumes, a cancelled one ends."""
        handle, item = entry.handle, entry.resumes
        if item is not None and item.parked is not None:
            if handle.cancelled.is_set():
                self._finish(item, "aborted", None)
                return
            try:
                item.slot = self.runner.resume(item.parked)
            except Exception as exc:  # noqa: BLE001 - this request's failure ends this request only
                self._fail(item, "resuming", exc)
                return
            item.parked = None
            self._active.append(item)
            return
        if handle.cancelled.is_set():
            self._resolve(handle, _result(handle.request, [], "", "aborted", None, 0, 0, 0))
            return
        try:
            self._active.append(self._start(handle, entry.on_stream))
        except Exception as exc:  # this request cannot start; the others go on
            if not isinstance(exc, ValueError):
                log.exception("request %s failed to start", handle.request_id)
            handle.resolve(_result(handle.request, [], "", "error", None, 0, 0, 0), error=exc)

    def _start(self, handle: RequestHandle, on_stream: StreamCallback | None) -> _Active:
        request = handle.request
        params, grammar = request.params, None
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        if handle.grammar is not None:
            # The grammar's masks hold the stop tokens back until min_new_tokens, where the grammar allows
            # another token (GrammarState); the runner and the stop checker then need no minimum of their own.
            grammar = GrammarState(handle.grammar, self.runner.vocab_size, self.tokenizer,
                                   min_new_tokens=params.min_new_tokens, suppress_ids=stop_ids)
            params = replace(params, min_new_tokens=0)
        sampling = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                  repetition_penalty=params.repetition_penalty, seed=params.seed)
        started = self.clock()
        slot = self.runner.start(request.prompt_ids, sampling, min_new_tokens=params.min_new_tokens,
                                 suppress_ids=stop_ids, cache_scope=request.tenant,
                                 publish=params.record)  # fmt: skip
        seconds = self.clock() - started
        try:
            cached = self.runner.num_reused(slot)
            if not cached:  # a fresh prefill prices a token (the root is the first step's)
                self.prefill_costs.observe(len(request.prompt_ids) - 1, seconds)
            prefill = attribute_prefill(seconds, self.prefill_costs.cached_seconds(cached) if cached else 0.0)
            session = GuardedSession(self.proposer, request, handle.request_id)
            prompt_hidden = self.runner.take_prompt_hidden(slot)
            if prompt_hidden is not None:
                session.observe_hidden(prompt_hidden)
            stop = StopChecker(params, self.tokenizer, self.eos_token_ids, self.runner.max_len - len(request.prompt_ids))
            return _Active(handle, slot, session, stop, on_stream, grammar, cached=cached, prefill=prefill)
        except BaseException:
            self.runner.release(slot, keep_cache=False)
            raise

    def _propose(self, batch: list[_Active]) -> tuple[list[_Active], list[_Draft]]:
        """Each request's draft, cut by the budget to the batch's width (the runner pads every request
        to the widest draft, so the width is chosen for the batch: ``DraftBudget.select_batch``), then
        put under its grammar; the requests that still go on (one whose drafting or grammar failed has
        ended) and their drafts."""
        proposed: list[tuple[_Active, DraftTree, int, float | None]] = []
        for item in batch:
            try:
                proposed.append((item, *self._proposal(item)))
            except Exception as exc:  # noqa: BLE001 - this request's failure ends this request only
                self._fail(item, "drafting its step", exc)
        keeps = self.config.budget.select_batch([tree for _, tree, _, _ in proposed],
                                                [room for _, _, room, _ in proposed],
                                                [item.tracker.scale for item, _, _, _ in proposed])  # fmt: skip
        items, drafts = [], []
        for (item, tree, room, seconds), keep in zip(proposed, keeps):
            draft = _Draft(tree if len(keep) == len(tree) else subtree(tree, keep), keep, tree.match_len, seconds)
            try:
                draft = draft if item.grammar is None else self._constrain(item, draft, room)
            except Exception as exc:  # noqa: BLE001 - this request's grammar failure ends this request only
                self._fail(item, "drafting its step", exc)
                continue
            items.append(item)
            drafts.append(draft)
        return items, drafts

    def _proposal(self, item: _Active) -> tuple[DraftTree, int, float | None]:
        """One request's proposed tree, the most nodes it may verify, and what proposing took (None
        when it did not propose: no room, or a request that does not speculate)."""
        budget = self.config.budget
        room = min(budget.max_draft_tokens, self.runner.max_draft_nodes, self.runner.remaining(item.slot) - 1,
                   item.stop.max_new_tokens - len(item.stop.token_ids) - 1)  # drafts past the last token are waste
        if room <= 0 or not item.handle.request.params.speculate:
            return DraftTree.empty(), 0, None
        t0 = time.perf_counter()
        tree = item.session.propose(room)  # a failing drafter gives an empty draft (GuardedSession)
        return tree, room, time.perf_counter() - t0

    @staticmethod
    def _constrain(item: _Active, draft: _Draft, room: int) -> _Draft:
        """The draft under the request's grammar: forced tokens added, forbidden nodes dropped, row masks."""
        assert item.grammar is not None
        tree, keep, mask = item.grammar.constrain(draft.tree, draft.keep, room, jump_forward=room > 0)
        return replace(draft, tree=tree, keep=keep, token_mask=mask)

    def _verify(self, batch: list[_Active], drafts: list[_Draft]
                ) -> tuple[list[_Active], list[_Draft], list[VerifyResult]]:
        """One forward pass over every request's tree. A tree of sampled nodes carries their q
        (neural_drafters/hybrid.py); the budget's cuts drop it. When the pass fails before committing
        anything, each request is verified alone, so one request's failure ends only that request; a
        failure after tokens were committed ends the step's requests. Returns what was verified."""
        if not batch:
            return [], [], []
        steps = [VerifyStep(item.slot, d.tree, getattr(d.tree, "q", None), getattr(d.tree, "q_mode", "iid"),
                            d.token_mask) for item, d in zip(batch, drafts)]
        fit = self.step_costs
        started = fit.clock() if fit is not None else 0.0
        before = [self.runner.remaining(item.slot) for item in batch]
        try:
            results = self.runner.verify(steps)
            if fit is not None:  # rows beyond the first: B requests padded to the longest tree
                fit.observe(len(steps) * (1 + max(len(d.tree) for d in drafts)) - 1, fit.clock() - started,
                            len(steps))
            return batch, drafts, results
        except Exception as exc:  # a failing verifier fails requests, never the engine
            if len(batch) == 1 or before != [self.runner.remaining(item.slot) for item in batch]:
                log.exception("verification failed; failing %d requests", len(batch))
                for item in batch:
                    self._finish(item, "error", None, error=exc)
                return [], [], []
        log.warning("verification of %d requests failed; verifying each alone", len(batch))
        kept: tuple[list[_Active], list[_Draft], list[VerifyResult]] = ([], [], [])
        for item, draft, step in zip(batch, drafts, steps):
            try:
                result = self.runner.verify([step])[0]
            except Exception as exc:  # noqa: BLE001 - this request's verification failed: it alone ends
                self._fail(item, "verifying its draft", exc)
                continue
            kept[0].append(item)
            kept[1].append(draft)
            kept[2].append(result)
        return kept

    def _postprocess(self, batch: list[_Active], drafts: list[_Draft], results: list[VerifyResult]
                     ) -> list[StepReport]:
        """Stop conditions, one ``Verified`` per session, streams, and finished requests; the reports."""
        reports = []
        for item, draft, result in zip(batch, drafts, results):
            try:
                reports.append(self._commit(item, draft, result))
            except Exception as exc:  # noqa: BLE001 - this request's failure ends this request only
                self._fail(item, "committing its tokens", exc)
        return reports

    def _observe(self, reports: list[StepReport], seconds: float) -> None:
        """Hand the observer the step's reports, each with its share of the step's ``seconds`` (by rows
        verified) against what its tokens would have cost in plain steps of this batch size on the fitted
        step cost (serving/savings.py: no plain step measured yet, no saving claimed)."""
        if self.config.observer is None or not reports:
            return
        plain = self.step_costs.plain_step(len(reports)) if self.step_costs is not None else None
        costs = attribute_step(seconds, [1 + r.num_draft for r in reports], [r.num_tokens for r in reports], plain)
        try:
            self.config.observer.on_step([replace(r, cost=c) for r, c in zip(reports, costs)])
        except Exception:  # metering must not stop decoding
            log.exception("the step observer failed")

    def _commit(self, item: _Active, draft: _Draft, result: VerifyResult) -> StepReport:
        """One request's part of the step's postprocessing, and its report for the observer."""
        outcome = item.stop.append(result.token_ids.tolist())
        kept = outcome.token_ids
        accepted = result.accepted[: len(kept)]  # a stop condition may end the step inside the path
        item.tracker.update(draft.tree, result.accepted)
        if item.grammar is not None:
            item.grammar.advance(kept)
        hidden = None if result.hidden_states is None else result.hidden_states[: len(kept)]
        item.session.commit(Verified(np.asarray(kept, dtype=np.int32), _own_nodes(draft.keep[accepted]),
                                     len(draft.tree) > 0, hidden))  # fmt: skip
        item.steps += 1
        item.drafted += len(draft.tree)
        item.accepted += len(accepted)
        request = item.handle.request
        report = StepReport(request.tenant, len(draft.tree), len(accepted), draft.tree.source, draft.match_len,
                            draft.propose_seconds, request.params.speculate, len(kept), prefill=item.prefill)
        item.prefill = None
        if item.on_stream is not None and (kept or outcome.text_delta):
            try:
                item.on_stream(kept, outcome.text_delta)
            except Exception as exc:  # a broken consumer ends its own request only
                log.exception("stream callback failed for request %s", item.handle.request_id)
                self._finish(item, "error", None, error=exc)
                return report
        reason, matched = outcome.finish_reason, outcome.matched_stop
        if reason is None and self.runner.remaining(item.slot) < 1:
            reason = "length"  # the context limit
        if reason is not None:
            self._finish(item, reason, matched)
        return report

    def _fail(self, item: _Active, stage: str, exc: BaseException) -> None:
        """End one request with ``error`` after its own failure. A ``GrammarError`` (its grammar cannot go
        on: a ValueError) says what went wrong in the client's terms; anything else is logged and reaches
        the client as an internal error (a RuntimeError naming the stage)."""
        if isinstance(exc, GrammarError):
            log.info("request %s ended while %s: %s", item.handle.request_id, stage, exc)
        else:
            log.error("request %s failed while %s", item.handle.request_id, stage, exc_info=exc)
            if isinstance(exc, ValueError):  # not the client's value: do not report it as one
                wrapped = RuntimeError(f"the engine failed this request while {stage}")
                wrapped.__cause__ = exc
                exc = wrapped
        if item in self._active or item.parked is not None:
            self._finish(item, "error", None, error=exc)

    def _finish(self, item: _Active, reason: FinishReason, matched: int | str | None,
                error: BaseException | None = None) -> None:
        if item.parked is None:  # a parked request holds no slot: its rows went to the cache as it yielded
            self._active.remove(item)
            # A failed step may have half-written the rows; a request that asked not to be recorded
            # leaves nothing behind for later requests either.
            self.runner.release(item.slot, keep_cache=error is None and item.handle.request.params.record)
        item.handle.error = error
        result = _result(item.handle.request, item.stop.token_ids, item.stop.text, reason, matched, item.steps,
                         item.drafted, item.accepted, item.cached)
        item.session.finish(record=result.recorded and self.config.index_turns)
        if result.recorded and self.config.history_sink is not None:
            try:
                item.handle.stored = self.config.history_sink(result)
            except Exception as exc:  # the turn is not stored: its reply must say so
                log.exception("the history sink failed for request %s", item.handle.request_id)
                item.handle.stored = _NotStored(f"the history sink failed: {exc}")
        if self.config.observer is not None:
            try:
                self.config.observer.on_finish(result)
            except Exception:  # metering must not stop decoding
                log.exception("the step observer failed on request %s", item.handle.request_id)
        self._resolve(item.handle, result)

    @staticmethod
    def _resolve(handle: RequestHandle, result: GenerationResult) -> None:
        handle.resolve(result)

    def fail_all(self, error: BaseException) -> int:
        """The engine cannot go on (its thread is ending): every waiting and active request fails with
        ``error`` and gets its slot back. Returns how many failed."""
        with self._lock:
            waiting = [entry.handle for entry in self._waiting]
            self._waiting.clear()
        for item in list(self._active):
            self._active.remove(item)
            try:
                self.runner.release(item.slot, keep_cache=False)
            except Exception:
                log.debug("releasing slot %d failed", item.slot, exc_info=True)
            waiting.append(item.handle)
        for handle in waiting:
            if not handle.done.is_set():
                handle.resolve(error=error)
        return len(waiting)


def _own_nodes(nodes: np.ndarray) -> np.ndarray:
    """The accepted path's nodes that the session drafted: up to the first one a grammar forced (-1)."""
    forced = np.nonzero(nodes < 0)[0]
    return np.asarray(nodes[: forced[0]] if len(forced) else nodes, dtype=np.int32)


def _check(request: Request, tokenizer: Any) -> None:
    """What the engine needs of a request before it queues it (a served request passed the serving
    core's checks; one made without the service, such as offline replay's, is checked here)."""
    if not request.prompt_ids:
        raise ValueError("prompt_ids is empty: at least one token is needed")
    if any(not isinstance(t, int) or t < 0 for t in request.prompt_ids):
        bad = next(t for t in request.prompt_ids if not isinstance(t, int) or t < 0)
        raise ValueError(f"prompt_ids must be non-negative ints, got {bad!r}")
    if not request.tenant:
        raise ValueError("tenant must be a non-empty string")
    check_stopping(request.params, tokenizer)


def _result(request: Request, output: Sequence[int], text: str, reason: FinishReason,
            matched: int | str | None, steps: int, drafted: int, accepted: int, cached: int = 0) -> GenerationResult:
    usage = Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=len(output), cached_tokens=cached,
                  steps=steps, drafted_tokens=drafted, accepted_tokens=accepted)
    return GenerationResult(request, tuple(output), text, reason, matched, usage)


def _step_costs(budget: Any, runner: ModelRunner) -> StepCostFit | None:
    """The budget's measured cost model, calibrated on ``runner`` if it has measured nothing yet (a
    budget with a fixed ``CostModel`` is left as it is; a runner that verifies no draft needs no fit)."""
    fit = getattr(budget, "cost_model", None)
    if not isinstance(fit, StepCostFit):
        return None
    if not fit.num_observed:
        import torch  # lazily, as everywhere outside the verifier: the CLI starts without it

        fit.use_clock_for(runner.device, torch.get_num_threads())
        if runner.max_draft_nodes and getattr(budget, "adaptive", True):
            fit.calibrate(runner)
    return fit
