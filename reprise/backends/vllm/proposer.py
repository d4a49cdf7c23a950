"""Reprise's drafter as vLLM's speculative proposer (``speculative_config.method = "custom_class"``).

vLLM builds this class in its worker process (``RepriseVllmProposer(vllm_config)``) and calls
``propose`` once per engine step, after the step's tokens are committed, with every batch row's
committed tokens (``token_ids_cpu``, ``num_tokens_no_spec``). The call carries no request ids; the
worker extension (``worker.RepriseWorkerExtension.reprise_attach``) hands the proposer the model runner,
whose ``input_batch.req_ids`` and ``requests[...].sampling_params.extra_args`` name each row's request
and its ``RequestTag`` (tenant, session), set by the service after authentication.

Per request the proposer keeps a Reprise drafting session of the request's tenant (its own
``RepriseProposer`` state: history, corpus, calibration, acceptance monitor), commits the tokens the
step added, and sends the best path of the session's tree (``retrieval.chain``), since vLLM verifies
chains. Per step:

    for each row with new tokens: commit them (the accepted part of the last draft, then the bonus),
        record (tenant, draft length, accepted; on a timed step its tokens and its share of the step's
        time) for the service's accounting, and hand its tokens to the plain schedule that prices what
        they would have cost without drafts (serving/plain_schedule.py), propose the
        next chain, its first token re-ranked by the target's own logits for the tree's roots
        (``first_token``: the hidden state the row's last token was sampled from, times the output
        embedding's rows); where that chain expects little, a Medusa head's chain from the same hidden
        state instead (``fallback``, when the engine was started with a head)
    cut the chains to what the step pays for: its surest draft tokens overall, as many as maximise the
        step's tokens per second on vLLM's step cost measured on this engine as it runs
        (``step_cost.StepCostMeter``, ``VllmStepCost.cut``; each request's share of the attached
        ``DraftBudget``'s table until then), probabilities scaled by how each request's own drafts
        fared (``AcceptanceTracker``)
    requests that left the batch: end their sessions (their turns reach the history from the service)

Failures never reach vLLM: drafting runs on a helper thread with a deadline; a step whose drafting
raises or overruns ``stall_timeout_s`` drafts nothing (one warning per episode: an episode ends after
``RECOVERY_STEPS`` good steps in a row), and while a stalled drafting call is still running, later steps
draft nothing rather than wait.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from reprise.backends.vllm.fallback import SOURCE as NEURAL
from reprise.backends.vllm.fallback import FallbackPayoff, NeuralFallback
from reprise.backends.vllm.first_token import FirstTokenRerank
from reprise.backends.vllm.step_cost import StepCostMeter, VllmStepCost
from reprise.backends.vllm.tags import RequestTag, StepRecord, StepWire
from reprise.engine.draft_budget import AcceptanceTracker, DraftBudget
from retrieval.draft_tree import subtree
from retrieval.session import Verified
from serving.plain_schedule import UNPRICED_HOLD_S, PlainSchedule
from serving.savings import share

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 1.0
RECOVERY_STEPS = 16  # good steps in a row that end a failure episode (the next failure warns again)
_MAX_PENDING_STEPS = 200_000  # step records kept for the service between two drains
DEFAULT_MAX_BATCH = 256  # a plain engine's batch limit where vLLM's scheduler config does not say


@dataclass(slots=True)
class _Request:
    """Drafting state of one vLLM request in the worker."""

    tag: RequestTag
    session: Any  # a retrieval.chain.ChainSession, or None when the request does not draft
    seen: int  # tokens (prompt + output) committed to the session so far
    draft: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # last chain sent
    chain: Any = None  # the DraftTree of the last chain sent (for the request's acceptance tracker)
    source: str = ""
    tracker: AcceptanceTracker | None = None  # this request's own calibration of its drafts' probabilities
    replaced: float = 0.0  # what the retrieval chain the last (neural) chain replaced expected
    stopping: _Stopping | None = None  # where vLLM ends its output (None: not known here)


@dataclass(slots=True)
class _Stopping:
    """Where vLLM ends a request's output: at ``max_tokens``, or at a stop token (the EOS unless
    ignored, ``stop_token_ids``) once ``min_tokens`` are out. A step that accepts drafts past the end
    writes them to the runner's token buffer before the scheduler cuts them; the user never gets them,
    so the savings estimate must not count them."""

    max_tokens: int | None
    min_tokens: int
    stops: frozenset[int]
    produced: int = 0  # output tokens delivered so far (the first one, the prefill's, included)
    ended: bool = False

    @property
    def over(self) -> bool:
        """Whether the output has ended (a stop token, or ``max_tokens`` out)."""
        return self.ended or (self.max_tokens is not None and self.produced >= self.max_tokens)

    @classmethod
    def of(cls, params: Any) -> _Stopping | None:
        if params is None or not hasattr(params, "max_tokens"):
            return None
        stops = set(getattr(params, "stop_token_ids", None) or ())
        eos = getattr(params, "eos_token_id", None)
        if eos is not None and not getattr(params, "ignore_eos", False):
            stops.add(int(eos))
        return cls(getattr(params, "max_tokens", None), int(getattr(params, "min_tokens", 0) or 0), frozenset(stops))

    def deliver(self, new: np.ndarray) -> int:
        """How many of ``new`` (a step's tokens, in order) reach the user."""
        n = 0
        for token in new.tolist():
            if self.over:
                break
            n += 1
            self.produced += 1
            if token in self.stops and self.produced > self.min_tokens:
                self.ended = True
        return n


@dataclass(frozen=True, slots=True)
class _StepTime:
    """A step as the proposer timed it: its ``seconds``, each request's ``weights`` in it (rows verified
    on a steady step, tokens scheduled on one that prefilled), its ``batch_size``, and the cost of a plain
    step (one row per request) of that batch (None: a step that prefilled, or no price yet).
    ``prefilled``: some request prefilled (a chunk of) its prompt in it."""

    seconds: float
    weights: dict[str, int]
    batch_size: int
    plain_step_seconds: float | None
    prefilled: bool = False

    def share(self, req_id: str) -> float:
        """The request's seconds of the step: its weight's part (serving/savings.py)."""
        return share(self.seconds, self.weights.get(req_id, 1), sum(self.weights.values()), 0, self.batch_size,
                     None).seconds


@dataclass(slots=True)
class ProposerHealth:
    """Counters of degraded steps (the service reads them with ``reprise_health``)."""

    failed_steps: int = 0
    stalled_steps: int = 0
    skipped_steps: int = 0  # a stalled drafting call was still running
    warnings: int = 0
    reranked_steps: int = 0  # chains whose first token the target's logits changed
    fallback_steps: int = 0  # chains the neural fallback drafted instead of retrieval
    fallback_rests: int = 0  # times the neural fallback was found not to pay and rested (FallbackPayoff)


class RepriseVllmProposer:
    """The custom proposer class vLLM instantiates; inert (drafts nothing) until ``attach``."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.runner: Any = None
        self.tenants: Any = None  # retrieval.proposer.RepriseProposer, set by attach
        self.chain_factor = 2
        self.stall_timeout_s = DEFAULT_STALL_TIMEOUT_S
        self.health = ProposerHealth()
        self._budget: DraftBudget | None = None
        self._cost: VllmStepCost | None = None  # the measured step cost the cut uses (None: the budget's table)
        self._requests: dict[str, _Request] = {}
        self._steps: list[StepWire] = []
        self._steps_lock = threading.Lock()
        scheduler = getattr(vllm_config, "scheduler_config", None)
        self.schedule = PlainSchedule(int(getattr(scheduler, "max_num_seqs", 0) or DEFAULT_MAX_BATCH))
        self._schedule_lock = threading.Lock()  # the drafting thread steps it, a drain flushes it
        self.unpriced_hold_s = UNPRICED_HOLD_S
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reprise-draft")
        self._running: Future[list[list[int]]] | None = None
        self._warned = False
        self._good_steps = 0  # good steps since the last failure
        self._unattached_warned = False
        self.step_cost = StepCostMeter()
        self._step_start: float | None = None  # when the runner began the step now ending (execute_model)
        self._scheduled: dict[str, int] = {}  # that step's scheduled tokens per request
        self._prefilling: dict[str, list[float]] = {}  # requests still prefilling: [when scheduled, seconds so far]
        self.first_token: FirstTokenRerank | None = None
        self.fallback: NeuralFallback | None = None  # a Medusa head's chains where retrieval has little
        self.payoff = FallbackPayoff()
        self._num_steps = 0  # propose calls so far (the payoff's clock)
        self._out_embed: Any = None  # the target's output embedding [vocab, hidden] (first_token)
        self._step_hidden: Any = None  # (sample_hidden_states, spec_decode_metadata) of the running step
        # (call time, batch, rows verified next, the call's own seconds, the batch's context tokens)
        self._last_step: tuple[float, tuple[str, ...], int, float, int] | None = None

    # ---- vLLM's side ---------------------------------------------------------------------------------

    def load_model(self, model: Any) -> None:
        """vLLM's CPU runner calls this with the target model; the proposer needs no model."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """One draft (a chain of token ids, possibly empty) per batch row. Never raises."""
        num_rows = len(sampled_token_ids)
        empty: list[list[int]] = [[] for _ in range(num_rows)]
        if self.runner is None or self.tenants is None:
            if not self._unattached_warned:
                self._unattached_warned = True
                log.warning("the Reprise proposer is not attached to a runner (reprise_attach was not called): "
                            "it drafts nothing")
            return empty
        if self._running is not None and not self._running.done():
            self.health.skipped_steps += 1  # the stalled call still holds the sessions
            return empty
        now = time.perf_counter()
        self._num_steps += 1
        try:
            req_ids = list(self.runner.input_batch.req_ids[:num_rows])
            lengths = np.asarray(num_tokens_no_spec[:num_rows], dtype=np.int64).copy()
            timed = self._time_step(now, req_ids, sampled_token_ids, int(lengths.sum()))
            rows = [(i, req_ids[i], self._tag(req_ids[i])) for i in range(num_rows) if sampled_token_ids[i]]
            if timed is not None:  # rows still prefilling a prompt chunk: their share of the step is prefill
                for i in range(num_rows):
                    if not sampled_token_ids[i]:
                        self._record_prefill_chunk(req_ids[i], self._tag(req_ids[i]), timed)
            # A copy: after a stall vLLM goes on writing its buffer while the late call still reads.
            tokens = np.array(token_ids_cpu[:num_rows, : int(lengths.max(initial=0))], dtype=np.int32)
            live = set(self.runner.requests)
            hidden = self._row_hidden(sampled_token_ids)
            self._running = self._pool.submit(self._draft_step, rows, lengths, tokens, live, num_rows, timed, hidden,
                                              now)
            drafts = self._running.result(timeout=self.stall_timeout_s)
        except FutureTimeout:
            self._good_steps = 0
            self.health.stalled_steps += 1
            self._warn(f"Reprise drafting took longer than {self.stall_timeout_s:g} s: the step drafts nothing "
                       "(and so do later steps until the call returns)")
            return empty
        except Exception as exc:  # noqa: BLE001 - a failing drafter means no draft, never a failed step
            self._good_steps = 0
            self.health.failed_steps += 1
            self._warn(f"Reprise drafting failed ({type(exc).__name__}: {exc}): the step drafts nothing")
            return empty
        self._good_steps += 1
        if self._good_steps >= RECOVERY_STEPS:  # a sustained recovery ends the episode
            self._warned = False
        own = time.perf_counter() - now
        self.step_cost.observe_propose(own)
        self._last_step = (now, tuple(req_ids), num_rows + sum(len(d) for d in drafts), own, int(lengths.sum()))
        return drafts

    def _time_step(self, now: float, req_ids: list[str], sampled_token_ids: list[list[int]], context: int = 0
                   ) -> _StepTime | None:
        """Time the step that just ran for the savings estimate, feed the cost meters from it when it was
        a steady decoding step, and now and then hand the step budgets the measured step cost.

        A steady step's seconds: the time since the last call (the step, the engine's work between
        steps and the proposer's last call). A step that was not a steady one (a request joined, left or
        is prefilling: the engine may have been idle, or busy with other work, since the last call) is
        timed from when the runner began it (``_time_steps``) and the meters learn nothing from it; its
        time is shared by the tokens each request scheduled. Every timed step's decoding tokens go to the
        plain schedule (``PlainSchedule``), which prices them; a prefilling row's share is prefill time,
        priced at its own time (no saving claimed), so that the tenant's figures cover all of its engine
        time, as a run without Reprise would be timed. vLLM's prefix cache is vLLM's own (a vLLM without
        Reprise has it too): the prompt tokens it gives are no saving of Reprise's here. None: no step to
        time (the first, or a step the runner did not report)."""
        last, self._last_step = self._last_step, None
        started, self._step_start = self._step_start, None
        scheduled, self._scheduled = self._scheduled, {}
        batch = len(req_ids)
        steady = (last is not None and last[1] == tuple(req_ids) and all(sampled_token_ids)
                  and now - last[0] <= self.step_cost.max_gap_s)
        if not steady:  # timed from the runner's start: the engine may have been idle before it
            if started is None:
                return None
            decoding = all(sampled_token_ids) and not self._prefilling.keys() & set(req_ids) and all(
                scheduled.get(r, 1) <= 1 + (len(self._requests[r].draft) if r in self._requests else 0)
                for r in req_ids)  # a decoding step after the batch changed: priced like a steady one
            return _StepTime(now - started, {r: scheduled.get(r, 1) for r in req_ids}, batch,
                             self.step_cost.plain_step(batch, context) if decoding else None, prefilled=not decoding)
        assert last is not None
        seconds = now - last[0]  # the step and the engine's work between steps, as a plain engine's
        # less the proposer's own call; the step read the contexts the last call saw
        self.step_cost.observe(batch, last[2] - batch, seconds - last[3], last[4])
        fit = self.step_cost.fit()
        if fit is not None and self.step_cost.num_steps % 32 == 0:  # the cut prices drafts by it from now
            self._cost = fit
        weights = {r: 1 + len(self._requests[r].draft) if r in self._requests else 1 for r in req_ids}
        return _StepTime(seconds, weights, batch, self.step_cost.plain_step(batch, context))

    def _record_prefill_chunk(self, req_id: str, tag: RequestTag | None, timed: _StepTime) -> None:
        """A row that prefilled a prompt chunk and sampled nothing: its share of the step, as prefill."""
        if tag is not None:
            seconds = timed.share(req_id)
            if req_id in self._prefilling:
                self._prefilling[req_id][1] += seconds
            self._record(StepRecord(tag.tenant, 0, 0, "", prefill_seconds=seconds, plain_prefill_seconds=seconds))

    def _row_hidden(self, sampled_token_ids: list[list[int]]) -> Any:
        """Each row's hidden state its last sampled token came from ([num_rows, hidden] float32 copy), or
        None when neither the first-token re-rank nor the neural fallback is on, or the step's states were
        not captured.

        vLLM computes logits at ``num_draft_tokens + 1`` positions per row (one without a draft); a row
        that accepted ``a`` draft tokens sampled ``a + 1`` tokens, the last from position ``a`` of its
        run."""
        captured = self._step_hidden
        if captured is None or self._out_embed is None or (self.first_token is None and self.fallback is None):
            return None
        import torch

        states, meta = captured
        num_rows = len(sampled_token_ids)
        per_row = np.ones(num_rows, dtype=np.int64)
        if meta is not None:
            per_row += np.asarray(meta.num_draft_tokens[:num_rows], dtype=np.int64)
        if len(getattr(meta, "num_draft_tokens", ())) > num_rows or int(per_row.sum()) > int(states.shape[0]):
            return None  # not the layout described above: no re-rank this step
        starts = np.concatenate(([0], np.cumsum(per_row)[:-1]))
        sampled = np.fromiter((len(t) for t in sampled_token_ids), dtype=np.int64, count=num_rows)
        idx = starts + np.maximum(sampled - 1, 0)
        return states[torch.from_numpy(idx)].float()  # a copy: vLLM reuses its buffers next step

    # ---- drafting (helper thread) --------------------------------------------------------------------

    def _tag(self, req_id: str) -> RequestTag | None:
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        return RequestTag.from_extra_args(getattr(params, "extra_args", None))

    def _draft_step(self, rows: list[tuple[int, str, RequestTag | None]], lengths: np.ndarray,
                    token_ids: np.ndarray, live: set[str], num_rows: int,
                    timed: _StepTime | None = None, hidden: Any = None, now: float = 0.0) -> list[list[int]]:
        for req_id in [r for r in self._requests if r not in live]:
            self._end(req_id)
        self._prefilling = {r: v for r, v in self._prefilling.items() if r in live}  # left before their first token
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        chains: list[tuple[int, str, Any]] = []
        for i, req_id, tag in rows:
            chain = self._draft_row(req_id, tag, token_ids[i], int(lengths[i]), timed,
                                    None if hidden is None else hidden[i], now)
            if chain is not None and len(chain):
                chains.append((i, req_id, chain))
        self._price()
        batch = len(rows)
        for (i, req_id, chain), kept in zip(chains, self._cut(chains, batch, int(lengths[:num_rows].sum()))):
            req = self._requests[req_id]
            ids = kept.token_ids[: self.num_speculative_tokens]
            req.chain = kept
            req.draft = np.asarray(ids, dtype=np.int32)
            req.source = chain.source
            drafts[i] = [int(t) for t in ids]
        if self.fallback is not None and self.payoff.settle(self._num_steps):
            self.health.fallback_rests += 1
            log.info("the neural fallback's calls cost more than its chains saved over retrieval's: it rests "
                     "for %d steps", self.payoff.rest_steps)
        return drafts

    def _cut(self, chains: list[tuple[int, str, Any]], batch: int, context: int = 0) -> list[Any]:
        """Each chain cut to what the step pays for: once vLLM's step cost is measured, the step's surest
        draft tokens overall, as many as maximise its tokens per second (``VllmStepCost.cut``, the
        proposer's own call counted as paid either way); before, each request's share on the attached
        budget's table (``DraftBudget.choose``). Probabilities are scaled by how each request's drafts
        fared (``AcceptanceTracker``)."""
        trackers = [self._requests[r].tracker for _, r, _ in chains]
        scales = [t.scale if t is not None else 1.0 for t in trackers]
        budget = self._budget
        if budget is None:
            return [chain for _, _, chain in chains]
        if self._cost is None or not budget.adaptive:
            return [budget.choose(chain, self.num_speculative_tokens, scale, batch)
                    for (_, _, chain), scale in zip(chains, scales)]
        ranked = [budget.ranked(chain, self.num_speculative_tokens, scale)
                  for (_, _, chain), scale in zip(chains, scales)]
        counts = self._cost.cut([np.diff(gain) for _, gain in ranked], batch, self.step_cost.plain_step(batch, context),
                                self.step_cost.propose_seconds)
        return [chain if n == len(chain) else subtree(chain, np.sort(order[:n]).astype(np.int32))
                for (_, _, chain), (order, _), n in zip(chains, ranked, counts)]

    def _draft_row(self, req_id: str, tag: RequestTag | None, row: np.ndarray, length: int,
                   timed: _StepTime | None = None, hidden: Any = None, now: float = 0.0) -> Any:
        """Commit what the last step added to the request's session and propose its next chain."""
        req = self._requests.get(req_id)
        arriving = False
        if req is None:
            if tag is None:
                return None
            num_prompt = int(getattr(self.runner.requests.get(req_id), "num_prompt_tokens", 0) or 0)
            num_prompt = min(num_prompt, length) if num_prompt else max(length - 1, 0)
            session = self._begin(tag, row[:num_prompt]) if tag.speculate else None
            stopping = _Stopping.of(getattr(self.runner.requests.get(req_id), "sampling_params", None))
            req = self._requests[req_id] = _Request(tag, session, num_prompt, tracker=AcceptanceTracker(),
                                                    stopping=stopping)
            arriving = True
        new = np.asarray(row[req.seen:length], dtype=np.int32)
        if not len(new):
            return None
        req.seen = length
        accepted = _matched(req.draft, new[:-1])
        delivered = req.stopping.deliver(new) if req.stopping is not None else len(new)
        if req.source == NEURAL and len(req.draft) and timed is not None:  # what the head's chain won or lost
            plain = timed.plain_step_seconds if timed.plain_step_seconds is not None else timed.seconds
            self.payoff.credit(accepted - req.replaced, plain / max(timed.batch_size, 1))
        record = StepRecord(req.tag.tenant, len(req.draft), accepted, req.source if len(req.draft) else "")
        prefill = self._prefilling.pop(req_id, None)
        seconds = timed.share(req_id) if timed is not None else 0.0
        if arriving:  # the plain schedule follows it from when vLLM scheduled it, after its prefill's time
            with self._schedule_lock:
                self.schedule.arrive(req_id, req.tag.tenant, req.tag.session_id, prefill[0] if prefill else now,
                                     prefill[1] + seconds if prefill and timed is not None else 0.0, req.seen)
        if timed is not None and prefill is not None:  # its prompt's last chunk: prefill time
            self._record(replace(record, num_tokens=delivered, prefill_seconds=seconds, plain_prefill_seconds=seconds))
        elif timed is not None and timed.prefilled:
            # Decoding in a step that prefilled another prompt: a plain engine's step would have carried
            # one token of it too, at the same cost; the plain schedule prices the rest (``_price``).
            self._record(replace(record, num_tokens=delivered, seconds=seconds, plain_seconds=seconds if delivered else 0.0))
            with self._schedule_lock:
                self.schedule.deliver(req_id, max(delivered - 1, 0), 0.0, now)
        elif timed is not None:  # its share of the step; the plain schedule prices its tokens (``_price``)
            self._record(replace(record, num_tokens=delivered, seconds=seconds))
            with self._schedule_lock:
                self.schedule.deliver(req_id, delivered, seconds, now)
        else:
            self._record(record)
        if req.stopping is not None and req.stopping.over:
            with self._schedule_lock:
                self.schedule.finish(req_id)
        verified = Verified(new, np.arange(accepted, dtype=np.int32), draft_verified=len(req.draft) > 0)
        if req.chain is not None and req.tracker is not None:  # a request whose drafts fail verifies fewer
            req.tracker.update(req.chain, verified.accepted)
        req.draft, req.chain = np.zeros(0, dtype=np.int32), None
        if req.session is None:
            return None
        try:
            req.session.commit(verified)
            chain = req.session.propose(self.num_speculative_tokens)
            if hidden is not None and self.first_token is not None:
                chain = self._rerank(req.session, chain, hidden)
            if hidden is not None and self.fallback is not None:
                chain = self._fall_back(req, chain, hidden)
            return chain
        except Exception as exc:  # noqa: BLE001 - this request stops drafting; the others go on
            self.health.failed_steps += 1
            self._warn(f"Reprise drafting failed for a request of tenant {req.tag.tenant!r} "
                       f"({type(exc).__name__}: {exc}); it drafts nothing from now on")
            req.session = None
            return None

    def _rerank(self, session: Any, chain: Any, hidden: Any) -> Any:
        """``chain``, or the best path under another of the tree's roots where the target's logits for
        the roots say so (``first_token``)."""
        from retrieval.chain import root_paths

        assert self.first_token is not None
        paths, values = root_paths(session.tree, self.num_speculative_tokens)
        if len(paths) < 2:
            return chain
        top = paths[: self.first_token.top]
        roots = session.tree.token_ids[[int(p[0]) for p in top]]
        import torch

        logits = (self._out_embed[torch.from_numpy(roots.astype(np.int64))].float() @ hidden).numpy()
        pick = self.first_token.choose(values[: len(top)], logits)
        if pick == 0:
            return chain
        self.health.reranked_steps += 1
        return session.send(top[pick])

    def _fall_back(self, req: _Request, chain: Any, hidden: Any) -> Any:
        """``chain``, or the neural fallback's chain where retrieval's expects fewer accepted tokens than
        the tenant's ``hybrid_threshold`` and the head's expects more than retrieval's (``fallback``)."""
        assert self.fallback is not None
        config = self.tenants.tenant_config(req.tag.tenant) or self.tenants.config
        if chain.score >= config.hybrid_threshold or not self.payoff.active(self._num_steps):
            return chain
        started = time.perf_counter()
        head = self.fallback.draft(hidden, self.num_speculative_tokens)
        self.payoff.spent(time.perf_counter() - started)
        if head.score <= chain.score:
            return chain
        self.health.fallback_steps += 1
        req.replaced = chain.score
        return req.session.send_other(head)

    def _begin(self, tag: RequestTag, prompt: np.ndarray) -> Any:
        from retrieval.chain import ChainSession

        try:
            inner = self.tenants.begin(tag.tenant, tag.session_id, np.asarray(prompt, dtype=np.int32))
        except KeyError:  # a deleted tenant: nothing to draft from
            return None
        return ChainSession(inner, self.chain_factor)

    def _end(self, req_id: str) -> None:
        req = self._requests.pop(req_id)
        with self._schedule_lock:
            self.schedule.finish(req_id)
        if req.session is not None:
            try:
                req.session.finish(record=False)  # the service records the turn (the stored one)
            except Exception:
                log.debug("ending the drafting session of %s failed", req_id, exc_info=True)

    def _record(self, step: StepRecord) -> None:
        with self._steps_lock:
            if len(self._steps) < _MAX_PENDING_STEPS:
                self._steps.append(step.to_wire())

    def _price(self, finished: bool = False) -> None:
        """Take the plain steps the schedule can now price (``PlainSchedule.advance``) and hand each
        request's plain seconds to the service as a ``late`` record once its plain run ends. Requests
        still unpriced ``unpriced_hold_s`` after they finished (the meter has no step cost yet: it needs
        ``min_steps`` steady steps) go out at their own time (no saving claimed); ``finished``: every
        request has ended (a benchmark's pass is over), and what cannot be priced goes out now."""
        with self._schedule_lock:
            if finished:
                self.schedule.finish_all()
            ended = self.schedule.price(self.step_cost.plain_step, time.perf_counter(), self.unpriced_hold_s,
                                        finished=finished)
        for tenant, plain, _ in ended:
            if tenant is not None:
                self._record(StepRecord(tenant, 0, 0, "", plain_seconds=plain, late=True))

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            self.health.warnings += 1
            log.warning(message)

    # ---- the service's side (through the worker extension) -------------------------------------------

    def attach(self, runner: Any, tenants: Any, *, chain_factor: int, stall_timeout_s: float,
               budget: DraftBudget | None, first_token: FirstTokenRerank | None = None,
               fallback: NeuralFallback | None = None) -> None:
        """Start drafting: ``runner`` names the batch's requests, ``tenants`` (a ``RepriseProposer``)
        holds every tenant's drafting state; with ``first_token``, each chain's first token is re-ranked
        by the target's logits (where the runner has a model with a whole output embedding)."""
        self.runner = runner
        self.tenants = tenants
        self.chain_factor = chain_factor
        self.stall_timeout_s = stall_timeout_s
        self._budget = budget
        _time_steps(runner, self)
        self._out_embed = _output_embedding(runner) if first_token is not None or fallback is not None else None
        self.first_token = first_token if self._out_embed is not None else None
        self.fallback = fallback if self._out_embed is not None else None
        if self.fallback is not None:
            self.fallback.bind(self._out_embed)
        elif fallback is not None:
            log.warning("the neural fallback needs the target's whole output embedding on this rank: it is off")
        if self.first_token is not None or self.fallback is not None:
            _capture_hidden_states(runner, self)

    def drain_steps(self, held: bool = False) -> list[StepWire]:
        """The step records since the last drain (wire form of ``StepRecord``), with the plain costs the
        schedule priced by now (``_price``); ``held``: every request has ended (a benchmark that ends a
        pass wants all of its costs in it, priced or not)."""
        self._price(finished=held)
        with self._steps_lock:
            steps, self._steps = self._steps, []
        return steps

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _matched(draft: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading ``tokens`` equal ``draft``'s (the accepted draft tokens of a chain)."""
    n = min(len(draft), len(tokens))
    if n == 0:
        return 0
    miss = np.flatnonzero(draft[:n] != tokens[:n])
    return int(miss[0]) if len(miss) else n



def _output_embedding(runner: Any) -> Any:
    """The target's output embedding ([vocab, hidden] tensor) where this rank holds all of it, else None
    (tensor parallelism shards it; a runner without a model, as in unit tests)."""
    get_model = getattr(runner, "get_model", None)
    head = getattr(get_model() if get_model is not None else None, "lm_head", None)
    weight = getattr(head, "weight", None)
    vocab = getattr(head, "org_vocab_size", None)
    if weight is None or vocab is None or getattr(head, "tp_size", 1) != 1 or weight.shape[0] < vocab:
        return None
    return weight.detach()[:vocab]


def _time_steps(runner: Any, proposer: RepriseVllmProposer) -> None:
    """Wrap ``runner.execute_model`` (vLLM 0.32.0's ``GPUModelRunner``; ``versions.py`` pins it) so
    that the proposer knows when each step began (the first step after an idle engine has no earlier
    call to time it from), the tokens it scheduled per request, and which requests it began to prefill
    (``scheduled_new_reqs``)."""
    original = getattr(runner, "execute_model", None)
    if original is None or getattr(original, "reprise_wrapped", False):
        return

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        proposer._step_start = time.perf_counter()
        try:
            proposer._scheduled = dict(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
            for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
                proposer._prefilling.setdefault(new.req_id, [proposer._step_start, 0.0])
        except Exception:  # noqa: BLE001 - timing is best effort: a layout it does not know skips it
            proposer._scheduled = {}
        return original(scheduler_output, *args, **kwargs)

    execute_model.reprise_wrapped = True  # type: ignore[attr-defined]
    runner.execute_model = execute_model


def _capture_hidden_states(runner: Any, proposer: RepriseVllmProposer) -> None:
    """Wrap ``runner.propose_draft_token_ids`` (vLLM 0.32.0's ``GPUModelRunner``, which the CPU runner
    inherits; ``versions.py`` pins it) so that the proposer sees the step's sampled positions' hidden
    states and draft layout while vLLM calls ``propose``: the 5th and 7th arguments,
    ``sample_hidden_states`` [num_logits, hidden] and ``spec_decode_metadata`` (None without drafts)."""
    original = runner.propose_draft_token_ids
    if getattr(original, "reprise_wrapped", False):
        return

    def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
        proposer._step_hidden = (args[4], args[6]) if len(args) >= 7 else None
        try:
            return original(*args, **kwargs)
        finally:
            proposer._step_hidden = None

    propose_draft_token_ids.reprise_wrapped = True  # type: ignore[attr-defined]
    runner.propose_draft_token_ids = propose_draft_token_ids
