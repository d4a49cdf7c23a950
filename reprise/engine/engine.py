"""The decode loop: propose, verify, commit, record.

    engine = Engine(ModelRunner(model, num_slots=8), make_proposer("reprise"), tokenizer)
    result = engine.generate(prompt_ids, max_new_tokens=128)            # one request, this thread
    handle = engine.submit(request, on_stream=print); engine.run_until_idle()   # many, packed

Every ``Engine.step()`` does, for all active requests together:

1. admit waiting requests into free slots (prefill) and drop cancelled ones (slot freed at once);
2. **propose**: each request's drafting session proposes a tree; the draft budget keeps the part worth
   verifying (reprise/engine/draft_budget.py);
3. **verify**: one packed forward pass over every request's tree (verifier/runner.py);
4. **commit**: stop conditions cut the committed tokens (reprise/engine/stopping.py), the session and the
   stream receive exactly the kept tokens;
5. **record**: a finished request's prompt and output join its tenant's history
   (``session.finish(record=True)``) and go to the ``on_finish`` hook / history sink.

A drafter that fails yields an empty draft (the step still commits one token); a failing verifier is an
error. ``submit`` and ``cancel`` are thread-safe; ``step`` runs on one thread (the engine's owner).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reprise.engine.draft_budget import AcceptanceTracker, DraftBudget
from reprise.engine.request import GenerationRequest, GenerationResult, HistoryRecord, StoppingParams, Usage
from reprise.engine.stopping import StopChecker
from retrieval.draft_tree import DraftTree
from retrieval.session import DraftSession, Proposer
from verifier.runner import ModelRunner, VerifyStep
from verifier.sampling import SamplingParams

log = logging.getLogger(__name__)

StreamCallback = Callable[[list[int], str], None]  # (committed token ids, text delta)
HistorySink = Callable[[HistoryRecord], None]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings: the draft budget policy, EOS ids (default: the model's), and a history sink
    called with every recorded request (the privacy layer persists them)."""

    budget: DraftBudget = field(default_factory=DraftBudget)
    eos_token_ids: tuple[int, ...] | None = None
    history_sink: HistorySink | None = None


class RequestHandle:
    """A submitted request: ``wait()`` for its result, ``cancel()`` it from any thread."""

    def __init__(self, request: GenerationRequest, cancel: threading.Event | None) -> None:
        self.request = request
        self.request_id = request.request_id
        self.cancelled = cancel if cancel is not None else threading.Event()
        self.done = threading.Event()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None

    def cancel(self) -> None:
        self.cancelled.set()

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
    session: _GuardedSession
    stop: StopChecker
    on_stream: StreamCallback | None
    on_finish: HistorySink | None
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


class Engine:
    """Steps every active request together: one packed verification pass per step."""

    def __init__(
        self,
        runner: ModelRunner,
        proposer: Proposer,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.runner = runner
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        eos = self.config.eos_token_ids
        if eos is None:
            model_eos = runner.model.generation_config.eos_token_id
            eos = (
                () if model_eos is None else tuple(model_eos) if isinstance(model_eos, list) else (model_eos,)
            )
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        if getattr(proposer, "wants_hidden_states", False):
            runner.keep_hidden = True  # neural drafters read the target's states (session.observe_hidden)
        self._lock = threading.Lock()
        self._waiting: deque[tuple[RequestHandle, StreamCallback | None, HistorySink | None]] = deque()
        self._active: list[_Active] = []

    # ---- submission (any thread) ------------------------------------------------------------------
    def submit(
        self,
        request: GenerationRequest,
        *,
        on_stream: StreamCallback | None = None,
        on_finish: HistorySink | None = None,
        cancel: threading.Event | None = None,
    ) -> RequestHandle:
        """Queue a request; it is admitted at the next step with a free slot."""
        StopChecker(request.stopping, self.tokenizer, (), 1)  # reject unusable stop settings now
        if not request.request_id:
            request = _with_id(request)
        handle = RequestHandle(request, cancel)
        with self._lock:
            self._waiting.append((handle, on_stream, on_finish))
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

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, *, tenant: str = "default",
                 on_stream: StreamCallback | None = None, **stopping: Any) -> GenerationResult:  # fmt: skip
        """One request, decoded on this thread: ``stopping`` takes StoppingParams' fields."""
        request = GenerationRequest(
            tuple(int(t) for t in prompt_ids),
            sampling or SamplingParams(),
            StoppingParams(**stopping),
            tenant,
        )
        handle = self.submit(request, on_stream=on_stream)
        while not handle.done.is_set():
            self.step()
        return handle.wait()

    # ---- one step (engine thread) -----------------------------------------------------------------
    def step(self) -> int:
        """Admit, propose, verify, commit, record. Returns how many requests were stepped."""
        self._admit()
        for item in [a for a in self._active if a.handle.cancelled.is_set()]:
            self._finish(item, "cancelled", None)
        if not self._active:
            return 0
        trees = [self._propose(item) for item in self._active]
        try:
            results = self.runner.verify(
                [VerifyStep(item.slot, tree, getattr(tree, "q", None), getattr(tree, "q_mode", "iid"))
                 for item, tree in zip(self._active, trees)]
            )  # a tree of sampled nodes carries their q (neural_drafters/hybrid.py); the budget's cuts drop it
        except Exception as exc:  # a failing verifier fails this step's requests, not the engine
            log.exception("verification failed; failing %d requests", len(self._active))
            for item in list(self._active):
                self._finish(item, "cancelled", None, error=exc)
            return 0
        for item, tree, result in zip(list(self._active), trees, results):
            item.tracker.update(tree, result.accepted)
            outcome = item.stop.append(result.token_ids.tolist())
            if result.hidden_states is not None:  # the states before each kept token
                item.session.observe_hidden(result.hidden_states[: len(outcome.token_ids)])
            item.session.commit(outcome.token_ids)
            item.steps += 1
            item.drafted += len(tree)
            item.accepted += min(len(result.accepted), len(outcome.token_ids))
            if item.on_stream is not None and (outcome.token_ids or outcome.text_delta):
                try:
                    item.on_stream(outcome.token_ids, outcome.text_delta)
                except Exception as exc:  # a broken consumer ends its own request only
                    log.exception("stream callback failed for request %s", item.handle.request_id)
                    self._finish(item, "cancelled", None, error=exc)
                    continue
            reason, matched = outcome.finish_reason, outcome.matched_stop
            if reason is None and self.runner.remaining(item.slot) < 1:
                reason = "length"  # the context limit
            if reason is not None:
                self._finish(item, reason, matched)
        return len(results)

    def _propose(self, item: _Active) -> DraftTree:
        room = min(
            self.config.budget.max_draft_tokens,
            self.runner.max_draft_nodes,
            self.runner.remaining(item.slot) - 1,
            item.stop.max_tokens - len(item.stop.token_ids) - 1,  # drafts past the last token are waste
        )
        if room <= 0:
            return DraftTree.empty()
        tree = item.session.propose(room)  # a failing drafter gives an empty draft (_GuardedSession)
        return self.config.budget.choose(tree, room, item.tracker.scale, len(self._active))

    def _admit(self) -> None:
        while self.runner.num_free_slots:
            with self._lock:
                if not self._waiting:
                    return
                handle, on_stream, on_finish = self._waiting.popleft()
            request = handle.request
            if handle.cancelled.is_set():
                self._resolve(handle, _result(handle, [], "", "cancelled", None, 0, 0, 0))
                continue
            try:
                stop_ids = tuple(request.stopping.stop_token_ids) + (
                    () if request.stopping.ignore_eos else self.eos_token_ids
                )
                slot = self.runner.start(
                    request.prompt_ids, request.sampling, min_new_tokens=request.stopping.min_new_tokens,
                    suppress_ids=stop_ids,
                )  # fmt: skip
            except (ValueError, RuntimeError) as exc:
                handle.error = exc
                handle.done.set()
                continue
            session = _GuardedSession(self.proposer, request, handle.request_id)
            prompt_hidden = self.runner.take_prompt_hidden(slot)
            if prompt_hidden is not None:
                session.observe_hidden(prompt_hidden)
            max_tokens = self.runner.max_len - len(request.prompt_ids)
            stop = StopChecker(request.stopping, self.tokenizer, self.eos_token_ids, max_tokens)
            self._active.append(_Active(handle, slot, session, stop, on_stream, on_finish))

    def _finish(
        self, item: _Active, reason: str, matched: int | str | None, error: BaseException | None = None
    ) -> None:
        self._active.remove(item)
        self.runner.release(item.slot)
        request = item.handle.request
        item.handle.error = error
        record = request.record_history and reason != "cancelled" and error is None
        item.session.finish(record=record)
        output = item.stop.token_ids
        if record:
            history = HistoryRecord(
                request.tenant, request.session_id, item.handle.request_id, request.prompt_ids, tuple(output)
            )
            for sink in (item.on_finish, self.config.history_sink):
                if sink is not None:
                    sink(history)
        result = _result(
            item.handle, output, item.stop.text, reason, matched, item.steps, item.drafted, item.accepted
        )
        self._resolve(item.handle, result)

    @staticmethod
    def _resolve(handle: RequestHandle, result: GenerationResult) -> None:
        handle.result = result
        handle.done.set()


class _GuardedSession:
    """A drafting session whose failures degrade to "no more drafts" instead of failing the request
    (DESIGN.md: a failing drafter means an empty draft, never a wrong token or a lost request)."""

    def __init__(self, proposer: Proposer, request: GenerationRequest, request_id: str) -> None:
        self.request_id = request_id
        self.session: DraftSession | None = None
        try:
            self.session = proposer.begin(
                request.tenant, request.session_id, list(request.prompt_ids), request_id
            )
        except Exception:  # noqa: BLE001 - logged by _failed
            self._failed("begin")

    def _failed(self, what: str) -> None:
        log.exception("drafter %s failed for request %s; it drafts nothing more", what, self.request_id)
        self.session = None

    def propose(self, budget: int) -> DraftTree:
        if self.session is not None:
            try:
                tree = self.session.propose(budget)
                tree.validate()
                return tree
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("propose")
        return DraftTree.empty()

    def observe_hidden(self, states: Any) -> None:
        """Hand the target's hidden states to a session that reads them (neural drafters)."""
        observe = getattr(self.session, "observe_hidden", None)
        if observe is not None:
            try:
                observe(states)
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("observe_hidden")

    def commit(self, token_ids: list[int]) -> None:
        if self.session is not None:
            try:
                self.session.commit(token_ids)
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("commit")

    def finish(self, record: bool) -> None:
        if self.session is not None:
            try:
                self.session.finish(record=record)
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("finish")


def _with_id(request: GenerationRequest) -> GenerationRequest:
    from dataclasses import replace

    return replace(request, request_id=uuid.uuid4().hex)


def _result(handle, output, text, reason, matched, steps, drafted, accepted) -> GenerationResult:
    usage = Usage(len(handle.request.prompt_ids), len(output), steps, drafted, accepted)
    return GenerationResult(handle.request_id, tuple(output), text, reason, matched, usage)
