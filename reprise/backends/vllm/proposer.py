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
        record (tenant, draft length, accepted; on a steady step its share of the step's time and the
        plain-step estimate of its tokens: serving/savings.py) for the service's accounting, propose the
        next chain, its first token re-ranked by the target's own logits for the tree's roots
        (``first_token``: the hidden state the row's last token was sampled from, times the output
        embedding's rows)
    cut each chain to what the batch pays for (``DraftBudget``: fewer, surer tokens as the batch grows,
        its probabilities scaled by how the request's own drafts fared: ``AcceptanceTracker``; its cost
        per verified row measured on this engine as it runs: ``step_cost.StepCostMeter``)
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

from reprise.backends.vllm.first_token import FirstTokenRerank
from reprise.backends.vllm.step_cost import StepCostMeter
from reprise.backends.vllm.tags import RequestTag, StepRecord
from reprise.engine.draft_budget import AcceptanceTracker, DraftBudget
from retrieval.session import Verified
from serving.savings import share

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
    draft: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # last chain sent
    chain: Any = None  # the DraftTree of the last chain sent (for the request's acceptance tracker)
    source: str = ""
    tracker: AcceptanceTracker | None = None  # this request's own calibration of its drafts' probabilities


@dataclass(frozen=True, slots=True)
class _StepTime:
    """A step as the proposer timed it: ``seconds`` between two calls, the ``rows`` it verified, its
    ``batch_size``, and the fitted cost of a plain step (one row per request) of that batch (None: a step
    that was not a steady one, or no fitted line yet; priced at its own time)."""

    seconds: float
    rows: int
    batch_size: int
    plain_step_seconds: float | None


@dataclass(slots=True)
class ProposerHealth:
    """Counters of degraded steps (the service reads them with ``reprise_health``)."""

    failed_steps: int = 0
    stalled_steps: int = 0
    skipped_steps: int = 0  # a stalled drafting call was still running
    warnings: int = 0
    reranked_steps: int = 0  # chains whose first token the target's logits changed


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
        self._requests: dict[str, _Request] = {}
        self._steps: list[tuple[str, int, int, str, int, float, float]] = []
        self._steps_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reprise-draft")
        self._running: Future[list[list[int]]] | None = None
        self._warned = False
        self._good_steps = 0  # good steps since the last failure
        self._unattached_warned = False
        self.step_cost = StepCostMeter()
        self.first_token: FirstTokenRerank | None = None
        self._out_embed: Any = None  # the target's output embedding [vocab, hidden] (first_token)
        self._step_hidden: Any = None  # (sample_hidden_states, spec_decode_metadata) of the running step
        self._last_step: tuple[float, tuple[str, ...], int] | None = None  # (call time, batch, rows verified next)

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
        try:
            req_ids = list(self.runner.input_batch.req_ids[:num_rows])
            timed = self._time_step(now, req_ids, sampled_token_ids)
            rows = [(i, req_ids[i], self._tag(req_ids[i])) for i in range(num_rows) if sampled_token_ids[i]]
            lengths = np.asarray(num_tokens_no_spec[:num_rows], dtype=np.int64).copy()
            # A copy: after a stall vLLM goes on writing its buffer while the late call still reads.
            tokens = np.array(token_ids_cpu[:num_rows, : int(lengths.max(initial=0))], dtype=np.int32)
            live = set(self.runner.requests)
            hidden = self._row_hidden(sampled_token_ids)
            self._running = self._pool.submit(self._draft_step, rows, lengths, tokens, live, num_rows, timed, hidden)
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
        self._last_step = (now, tuple(req_ids), num_rows + sum(len(d) for d in drafts))
        return drafts

    def _time_step(self, now: float, req_ids: list[str], sampled_token_ids: list[list[int]]
                   ) -> _StepTime | None:
        """Feed the step cost meter with the step that just ran (when it was a steady decoding step),
        now and then hand the step budget the measured cost line, and return the step's time for the
        savings estimate. A step that was not a steady one (a request joined, left or is prefilling) is
        not a plain decoding step: the cost line learns nothing from it, and the estimate prices it at its
        own time (no saving claimed), so that the tenant's figures cover the whole of its engine time, as
        a run without Reprise would be timed. None: no step before, or an idle gap."""
        last, self._last_step = self._last_step, None
        if last is None:
            return None
        seconds = now - last[0]
        if last[1] != tuple(req_ids) or not all(sampled_token_ids):
            if seconds > self.step_cost.max_gap_s:
                return None
            return _StepTime(seconds, last[2], len(req_ids), None)
        self.step_cost.observe(last[2], seconds)
        line = self.step_cost.line()
        if (self._budget is not None and self._budget.adaptive and self.step_cost.num_steps % 32 == 0
                and line is not None):
            self._budget = DraftBudget(self._budget.max_draft_tokens, line.cost_model(), adaptive=True)
        if seconds > self.step_cost.max_gap_s:
            return None  # an idle gap, not a step
        batch = len(req_ids)
        return _StepTime(seconds, last[2], batch, line.a + line.b * batch if line is not None else None)

    def _row_hidden(self, sampled_token_ids: list[list[int]]) -> Any:
        """Each row's hidden state its last sampled token came from ([num_rows, hidden] float32 copy), or
        None when the first-token re-rank is off or the step's states were not captured.

        vLLM computes logits at ``num_draft_tokens + 1`` positions per row (one without a draft); a row
        that accepted ``a`` draft tokens sampled ``a + 1`` tokens, the last from position ``a`` of its
        run."""
        captured = self._step_hidden
        if captured is None or self._out_embed is None or self.first_token is None:
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
                    timed: _StepTime | None = None, hidden: Any = None) -> list[list[int]]:
        for req_id in [r for r in self._requests if r not in live]:
            self._end(req_id)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        chains: list[tuple[int, str, Any]] = []
        for i, req_id, tag in rows:
            chain = self._draft_row(req_id, tag, token_ids[i], int(lengths[i]), timed,
                                    None if hidden is None else hidden[i])
            if chain is not None and len(chain):
                chains.append((i, req_id, chain))
        batch = len(rows)
        for i, req_id, chain in chains:
            req = self._requests[req_id]
            scale = req.tracker.scale if req.tracker is not None else 1.0
            kept = self._budget.choose(chain, self.num_speculative_tokens, scale, batch) if self._budget else chain
            ids = kept.token_ids[: self.num_speculative_tokens]
            req.chain = kept
            req.draft = np.asarray(ids, dtype=np.int32)
            req.source = chain.source
            drafts[i] = [int(t) for t in ids]
        return drafts

    def _draft_row(self, req_id: str, tag: RequestTag | None, row: np.ndarray, length: int,
                   timed: _StepTime | None = None, hidden: Any = None) -> Any:
        """Commit what the last step added to the request's session and propose its next chain."""
        req = self._requests.get(req_id)
        if req is None:
            if tag is None:
                return None
            num_prompt = int(getattr(self.runner.requests.get(req_id), "num_prompt_tokens", 0) or 0)
            num_prompt = min(num_prompt, length) if num_prompt else max(length - 1, 0)
            session = self._begin(tag, row[:num_prompt]) if tag.speculate else None
            req = self._requests[req_id] = _Request(tag, session, num_prompt, tracker=AcceptanceTracker())
        new = np.asarray(row[req.seen:length], dtype=np.int32)
        if not len(new):
            return None
        req.seen = length
        accepted = _matched(req.draft, new[:-1])
        record = StepRecord(req.tag.tenant, len(req.draft), accepted, req.source if len(req.draft) else "")
        if timed is not None:  # its share of the step, and what its tokens would have cost in plain steps
            cost = share(timed.seconds, 1 + len(req.draft), timed.rows, len(new), timed.batch_size,
                         timed.plain_step_seconds)
            record = replace(record, num_tokens=len(new), seconds=cost.seconds, plain_seconds=cost.plain_seconds)
        self._record(record)
        verified = Verified(new, np.arange(accepted, dtype=np.int32), draft_verified=len(req.draft) > 0)
        if req.chain is not None and req.tracker is not None:  # a request whose drafts fail verifies fewer
            req.tracker.update(req.chain, verified.accepted)
        req.draft, req.chain = np.zeros(0, dtype=np.int32), None
        if req.session is None:
            return None
        try:
            req.session.commit(verified)
            chain = req.session.propose(self.num_speculative_tokens)
            return self._rerank(req.session, chain, hidden) if hidden is not None else chain
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

    def _record(self, step: StepRecord) -> None:
        with self._steps_lock:
            if len(self._steps) < _MAX_PENDING_STEPS:
                self._steps.append(step.to_wire())

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            self.health.warnings += 1
            log.warning(message)

    # ---- the service's side (through the worker extension) -------------------------------------------

    def attach(self, runner: Any, tenants: Any, *, chain_factor: int, stall_timeout_s: float,
               budget: DraftBudget | None, first_token: FirstTokenRerank | None = None) -> None:
        """Start drafting: ``runner`` names the batch's requests, ``tenants`` (a ``RepriseProposer``)
        holds every tenant's drafting state; with ``first_token``, each chain's first token is re-ranked
        by the target's logits (where the runner has a model with a whole output embedding)."""
        self.runner = runner
        self.tenants = tenants
        self.chain_factor = chain_factor
        self.stall_timeout_s = stall_timeout_s
        self._budget = budget
        self._out_embed = _output_embedding(runner) if first_token is not None else None
        self.first_token = first_token if self._out_embed is not None else None
        if self.first_token is not None:
            _capture_hidden_states(runner, self)

    def drain_steps(self) -> list[tuple[str, int, int, str, int, float, float]]:
        """The step records since the last drain (wire form of ``StepRecord``)."""
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
