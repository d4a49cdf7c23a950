"""Reprise's drafter as vLLM's speculative proposer (``speculative_config.method = "custom_class"``).

vLLM builds this class in its worker process (``RepriseVllmProposer(vllm_config)``) and calls
``propose`` once per engine step, after the step's tokens are committed, with every batch row's
committed tokens (``token_ids_cpu``, ``num_tokens_no_spec``). The call carries no request ids; the
worker extension (``worker.RepriseWorkerExtension.reprise_attach``) hands the proposer the model runner,
whose ``input_batch.req_ids`` and ``requests[...].sampling_params.extra_args`` name each row's request
and its ``RequestTag`` (tenant, session), set by the service after authentication.

Per request the proposer keeps a drafting session of the request's tenant (``retrieval.chain``: the best
path of the session's tree, since vLLM verifies chains). Per step:

    for each row with new tokens: commit them to its session (the accepted part of the last chain, then
        the bonus) and record the step for the service (tenant, draft length, accepted, tokens; on the
        step-cost meter's fit, the row's share of the step and its tokens' plain steps)
    if drafts pay at this batch size (``StepCostMeter.drafts_pay``), propose each row's next chain, its
        first token re-ranked by the target's logits (``first_token``) and, where it expects little, a
        Medusa head's chain instead (``fallback``); then cut the chains to what the step pays for
        (``VllmStepCost.cut`` on the measured step cost, the attached budget's table until then)

Failures never reach vLLM: drafting runs on a helper thread with a deadline; a step whose drafting
raises or overruns ``stall_timeout_s`` drafts nothing (one warning per episode: an episode ends after
``RECOVERY_STEPS`` good steps in a row), and while a stalled call still runs, later steps draft nothing.

The re-rank and the fallback read the target's hidden states, for which vLLM offers a custom proposer no
hook: ``target_states.TargetStates`` holds them (and the adapter's one wrapper of a runner method).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reprise.backends.vllm.fallback import SOURCE as NEURAL
from reprise.backends.vllm.fallback import NeuralFallback
from reprise.backends.vllm.first_token import FirstTokenRerank
from reprise.backends.vllm.step_cost import StepCostMeter
from reprise.backends.vllm.tags import RequestTag, StepRecord, StepWire
from reprise.backends.vllm.target_states import TargetStates
from reprise.engine.draft_budget import AcceptanceTracker, DraftBudget
from retrieval.draft_tree import subtree
from retrieval.session import Verified

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 1.0
RECOVERY_STEPS = 16  # good steps in a row that end a failure episode (the next failure warns again)
_MAX_PENDING_STEPS = 200_000  # step records kept for the service between two drains


@dataclass(slots=True)
class _Request:
    """Drafting state of one vLLM request in the worker."""

    tag: RequestTag
    session: Any  # a retrieval.chain.ChainSession, or None when the request does not draft
    seen: int  # tokens (prompt + output) committed to the session so far
    max_tokens: int | None  # output tokens vLLM delivers at most (accepted drafts past it never reach the user)
    produced: int = 0  # output tokens so far
    draft: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # last chain sent
    chain: Any = None  # the DraftTree of the last chain sent (for the request's acceptance tracker)
    source: str = ""
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)  # its own drafts' calibration
    replaced: float = 0.0  # what the retrieval chain the last (neural) chain replaced expected


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
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        self.runner: Any = None
        self.tenants: Any = None  # retrieval.proposer.RepriseProposer, set by attach
        self.chain_factor = 2
        self.stall_timeout_s = DEFAULT_STALL_TIMEOUT_S
        self.health = ProposerHealth()
        self.step_cost = StepCostMeter()
        self.states: TargetStates | None = None  # the target's hidden states: re-rank and fallback
        self._budget: DraftBudget | None = None
        self._requests: dict[str, _Request] = {}
        self._steps: list[StepWire] = []
        self._steps_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reprise-draft")
        self._running: Future[list[list[int]]] | None = None
        self._warned = False
        self._good_steps = 0  # good steps since the last failure
        self._num_steps = 0  # propose calls so far (the payoff's clock)

    # ---- vLLM's side ---------------------------------------------------------------------------------

    def load_model(self, model: Any) -> None:
        """vLLM's CPU runner calls this with the target model; the proposer needs no model."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """One draft (a chain of token ids, possibly empty) per batch row. Never raises."""
        num_rows = len(sampled_token_ids)
        empty: list[list[int]] = [[] for _ in range(num_rows)]
        if self.runner is None or self.tenants is None:
            self._warn("the Reprise proposer is not attached to a runner (reprise_attach was not called): it "
                       "drafts nothing")
            return empty
        if self._running is not None and not self._running.done():
            self.health.skipped_steps += 1  # the stalled call still holds the sessions
            return empty
        now = time.perf_counter()
        self._num_steps += 1
        try:
            req_ids = tuple(self.runner.input_batch.req_ids[:num_rows])
            lengths = np.asarray(num_tokens_no_spec[:num_rows], dtype=np.int64).copy()
            context = int(lengths.sum())
            self.step_cost.on_call(now, req_ids, all(sampled_token_ids), context,
                                   sum(len(t) for t in sampled_token_ids))
            rows = [(i, req_ids[i], self._tag(req_ids[i])) for i in range(num_rows) if sampled_token_ids[i]]
            # A copy: after a stall vLLM goes on writing its buffer while the late call still reads.
            tokens = np.array(token_ids_cpu[:num_rows, : int(lengths.max(initial=0))], dtype=np.int32)
            self._running = self._pool.submit(self._draft_step, rows, lengths, tokens, set(self.runner.requests),
                                              num_rows, self.states.rows(sampled_token_ids) if self.states else None)
            drafts = self._running.result(timeout=self.stall_timeout_s)
        except FutureTimeout:
            self._failed("stalled_steps", f"Reprise drafting took longer than {self.stall_timeout_s:g} s: the "
                         "step drafts nothing (and so do later steps until the call returns)")
            return empty
        except Exception as exc:  # noqa: BLE001 - a failing drafter means no draft, never a failed step
            self._failed("failed_steps", f"Reprise drafting failed ({type(exc).__name__}: {exc}): the step "
                         "drafts nothing")
            return empty
        self._good_steps += 1
        if self._good_steps >= RECOVERY_STEPS:  # a sustained recovery ends the episode
            self._warned = False
        self.step_cost.after_call(now, req_ids, num_rows + sum(len(d) for d in drafts), time.perf_counter() - now,
                                  context)
        return drafts

    # ---- drafting (helper thread) --------------------------------------------------------------------

    def _draft_step(self, rows: list[tuple[int, str, RequestTag | None]], lengths: np.ndarray,
                    token_ids: np.ndarray, live: set[str], num_rows: int, hidden: Any = None) -> list[list[int]]:
        """Commit each row's new tokens, record the step, and (where drafts pay) each row's next chain."""
        for req_id in [r for r in self._requests if r not in live]:
            self._end(req_id)
        context = int(lengths[:num_rows].sum())
        stepped = []  # (request, draft tokens it verified, accepted, tokens delivered)
        for i, req_id, tag in rows:
            req = self._requests.get(req_id)
            if req is None:  # its prompt's step: it drafts from here on, nothing to record
                self._arrive(req_id, tag, token_ids[i], int(lengths[i]))
            else:
                if self._resumed(req_id, req):  # vLLM dropped its last chain when it preempted it
                    req.draft, req.chain = np.zeros(0, dtype=np.int32), None
                stepped.append((req, *self._commit(req, token_ids[i], int(lengths[i]))))
        self._record_step(stepped, context)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if not self.step_cost.drafts_pay(len(rows)):
            return drafts
        chains: list[tuple[int, _Request, Any]] = []
        for i, req_id, _ in rows:
            req = self._requests.get(req_id)
            if req is None:
                continue
            chain = self._next_chain(req, None if hidden is None else hidden[i])
            if chain is not None and len(chain):
                chains.append((i, req, chain))
        for (i, req, chain), kept in zip(chains, self._cut([c for _, _, c in chains], [r for _, r, _ in chains],
                                                           len(rows), context)):
            req.chain, req.source = kept, chain.source
            req.draft = np.asarray(kept.token_ids[: self.num_speculative_tokens], dtype=np.int32)
            drafts[i] = req.draft.tolist()
        if self.states is not None:
            self.states.settle(self._num_steps)
        return drafts

    def _arrive(self, req_id: str, tag: RequestTag | None, row: np.ndarray, length: int) -> None:
        """A request's first step: its session begins over its prompt (the tokens before its first one)."""
        if tag is None:
            return  # no tenant: nothing it may draft from
        state = self.runner.requests.get(req_id)
        num_prompt = int(getattr(state, "num_prompt_tokens", 0) or 0)
        num_prompt = min(num_prompt, length) if num_prompt else max(length - 1, 0)
        max_tokens = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
        session = self._begin(tag, row[:num_prompt]) if tag.speculate else None
        req = self._requests[req_id] = _Request(tag, session, num_prompt, max_tokens)
        self._commit(req, row, length)

    def _resumed(self, req_id: str, req: _Request) -> bool:
        """Whether the request comes back from a preemption in this step (the fair-share scheduler's,
        scheduler.py, or vLLM's under KV pressure): vLLM freed its KV and recomputed tokens its session
        had already seen, and cleared the chain it had been sent, so no token of that chain was verified
        and none counts as rejected. Its session goes on: a preempted request stays in the runner's
        requests. (A recompute that starts at the last token seen looks like a plain step; the chain then
        counts as rejected.)"""
        computed = getattr(self.runner.requests.get(req_id), "num_computed_tokens", None)
        return isinstance(computed, int) and computed < req.seen - 1

    def _commit(self, req: _Request, row: np.ndarray, length: int) -> tuple[int, int, int]:
        """Hand the request's session the tokens the step added; returns (draft tokens it verified, of
        them accepted, tokens delivered: at most ``max_tokens`` in all, as vLLM delivers them)."""
        new = np.asarray(row[req.seen:length], dtype=np.int32)
        req.seen = length
        num_draft, accepted = len(req.draft), _matched(req.draft, new[:-1])
        delivered = len(new) if req.max_tokens is None else max(0, min(len(new), req.max_tokens - req.produced))
        req.produced += len(new)
        verified = Verified(new, np.arange(accepted, dtype=np.int32), draft_verified=num_draft > 0)
        if req.chain is not None:  # a request whose drafts fail verifies fewer
            req.tracker.update(req.chain, verified.accepted)
        if req.source == NEURAL and num_draft and self.states is not None:  # what the head's chain won or lost
            price = self.step_cost.price(1, 0, length)
            self.states.payoff.credit(accepted - req.replaced, price[1] if price is not None else 0.0)
        req.draft, req.chain = np.zeros(0, dtype=np.int32), None
        if req.session is not None and len(new):
            try:
                req.session.commit(verified)
            except Exception as exc:  # noqa: BLE001 - this request stops drafting; the others go on
                self._drop_session(req, exc)
        return num_draft, accepted, delivered

    def _record_step(self, stepped: list[tuple[_Request, int, int, int]], context: int) -> None:
        """The step's records for the service: each row's counts, its share of the step by rows and its
        tokens' plain steps on the meter's fit (serving/savings.py; no fit yet: counts alone)."""
        batch = len(stepped)
        draft_tokens = sum(n for _, n, _, _ in stepped)
        price = self.step_cost.price(batch, draft_tokens, context) if batch else None
        with self._steps_lock:
            for req, num_draft, accepted, delivered in stepped:
                if len(self._steps) >= _MAX_PENDING_STEPS:
                    break
                seconds = plain = 0.0
                if price is not None:
                    seconds = price[0] * (1 + num_draft) / (batch + draft_tokens)
                    plain = price[1] * delivered / batch
                self._steps.append(StepRecord(req.tag.tenant, num_draft, accepted, req.source if num_draft else "",
                                              delivered, seconds, plain).to_wire())

    def _next_chain(self, req: _Request, hidden: Any) -> Any:
        """The request's next chain: its session's, re-ranked and replaced where that pays (None: none)."""
        if req.session is None:
            return None
        try:
            chain = req.session.propose(self.num_speculative_tokens)
            if hidden is not None and self.states is not None:
                config = self.tenants.tenant_config(req.tag.tenant) or self.tenants.config
                chain, replaced = self.states.refine(req.session, chain, hidden, config.hybrid_threshold,
                                                     self._num_steps, self.num_speculative_tokens)
                req.replaced = replaced if replaced is not None else req.replaced
            return chain
        except Exception as exc:  # noqa: BLE001 - this request stops drafting; the others go on
            self._drop_session(req, exc)
            return None

    def _cut(self, chains: list[Any], reqs: list[_Request], batch: int, context: int) -> list[Any]:
        """Each chain cut to what the step pays for: once vLLM's step cost is measured, the step's surest
        draft tokens overall, as many as maximise its tokens per second (``VllmStepCost.cut``, the
        proposer's own call counted as paid either way); before, each request's share on the attached
        budget's table (``DraftBudget.choose``). Probabilities are scaled by how each request's drafts
        fared (``AcceptanceTracker``)."""
        budget, cost = self._budget, self.step_cost.cost
        if budget is None:
            return chains
        scales = [req.tracker.scale for req in reqs]
        if cost is None or not budget.adaptive:
            return [budget.choose(chain, self.num_speculative_tokens, scale, batch)
                    for chain, scale in zip(chains, scales)]
        ranked = [budget.ranked(chain, self.num_speculative_tokens, scale) for chain, scale in zip(chains, scales)]
        counts = cost.cut([np.diff(gain) for _, gain in ranked], batch, self.step_cost.plain_step(batch, context),
                          self.step_cost.propose_seconds)
        return [chain if n == len(chain) else subtree(chain, np.sort(order[:n]).astype(np.int32))
                for chain, (order, _), n in zip(chains, ranked, counts)]

    def _tag(self, req_id: str) -> RequestTag | None:
        params = getattr(self.runner.requests.get(req_id), "sampling_params", None)
        return RequestTag.from_extra_args(getattr(params, "extra_args", None))

    def _begin(self, tag: RequestTag, prompt: np.ndarray) -> Any:
        from retrieval.chain import ChainSession

        try:
            inner = self.tenants.begin(tag.tenant, tag.session_id, np.asarray(prompt, dtype=np.int32))
        except KeyError:  # a deleted tenant: nothing to draft from
            return None
        return ChainSession(inner, self.chain_factor)

    def _end(self, req_id: str) -> None:
        req = self._requests.pop(req_id)
        if req.session is not None:
            try:
                req.session.finish(record=False)  # the service records the turn (the stored one)
            except Exception:
                log.debug("ending the drafting session of %s failed", req_id, exc_info=True)

    def _drop_session(self, req: _Request, exc: Exception) -> None:
        self.health.failed_steps += 1
        self._warn(f"Reprise drafting failed for a request of tenant {req.tag.tenant!r} "
                   f"({type(exc).__name__}: {exc}); it drafts nothing from now on")
        req.session = None

    def _failed(self, counter: str, message: str) -> None:
        self._good_steps = 0
        setattr(self.health, counter, getattr(self.health, counter) + 1)
        self._warn(message)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            self.health.warnings += 1
            log.warning(message, exc_info=log.isEnabledFor(logging.DEBUG))

    # ---- the service's side (through the worker extension) -------------------------------------------

    def attach(self, runner: Any, tenants: Any, *, chain_factor: int, stall_timeout_s: float,
               budget: DraftBudget | None, first_token: FirstTokenRerank | None = None,
               fallback: NeuralFallback | None = None) -> None:
        """Start drafting: ``runner`` names the batch's requests, ``tenants`` (a ``RepriseProposer``)
        holds every tenant's drafting state; with ``first_token``, each chain's first token is re-ranked
        by the target's logits (where the runner has a model with a whole output embedding)."""
        self.runner, self.tenants, self._budget = runner, tenants, budget
        self.chain_factor, self.stall_timeout_s = chain_factor, stall_timeout_s
        self._warned = False
        self.states = TargetStates.attach(runner, first_token, fallback, self.health)

    def drain_steps(self) -> list[StepWire]:
        """The step records since the last drain (wire form of ``StepRecord``)."""
        with self._steps_lock:
            steps, self._steps = self._steps, []
        return steps

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _matched(draft: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading ``tokens`` equal ``draft``'s (the accepted draft tokens of a chain)."""
    n = min(len(draft), len(tokens))
    miss = np.flatnonzero(draft[:n] != tokens[:n])
    return int(miss[0]) if len(miss) else n
