"""Per-step drafting figures, per tenant and in Prometheus, from the engine's step reports.

The engine hands ``StepMeter.on_step`` one ``StepReport`` per request per step (drafted and accepted
counts as the verifier decided them, the draft's source, the drafting time, the request's share of the
step's time against its tokens' plain steps) and ``on_finish`` every finished request.
``TenantAccounting`` keeps the per-tenant figures the admin plane and the dashboard read (counted since
this process started), the savings estimate among them (serving/savings.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from reprise.engine.engine import StepReport
from reprise.engine.request import GenerationResult
from serving.admin import TenantStats
from serving.holdout import MeasuredSpeedup
from serving.savings import Savings

log = logging.getLogger(__name__)
MAX_POSITIONS = 64


@dataclass
class _Counts:
    num_requests: int = 0
    num_steps: int = 0
    num_drafted_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_beyond: list[int] = field(default_factory=lambda: [0] * MAX_POSITIONS)  # [i]: steps accepting > i
    drafter_steps: dict[str, int] = field(default_factory=dict)
    savings: Savings = field(default_factory=Savings)


class TenantAccounting:
    """Cumulative drafting figures per tenant since this process started (engine thread writes, others
    read). They are per process by design: each replica counts its own steps, and the admin plane and
    the dashboard say since when (``counting_since_unix_ms``). They are joined with the tenant's figures
    in the engine's prefix cache (``verifier.prefix_cache.PrefixCache``) when there is one."""

    def __init__(self, prefix_cache: Any = None, holdout: Any = None) -> None:
        self.refresh: Any = None  # called before figures are read: vLLM's backend drains the worker's steps
        self._counts: dict[str, _Counts] = {}
        self._lock = threading.Lock()
        self.since_unix_ms = int(time.time() * 1000)
        self._prefix_cache = prefix_cache
        self._holdout = holdout  # serving.holdout.Holdout: the measured speedup beside the estimate

    def record_steps(self, reports: Sequence[StepReport]) -> None:
        """One engine step: each request's drafted and accepted counts (one lock for the whole step)."""
        with self._lock:
            for r in reports:
                c = self._counts.setdefault(r.tenant, _Counts())
                c.num_steps += 1
                if r.prefill is not None:
                    c.savings = c.savings.add_prefill(r.prefill)
                if r.cost is not None:
                    c.savings = c.savings.add_step(r.cost, r.num_tokens)
                if r.num_draft:
                    c.num_drafted_steps += 1
                    c.num_draft_tokens += r.num_draft
                    c.num_accepted_tokens += r.num_accepted
                    for i in range(min(r.num_accepted, MAX_POSITIONS)):
                        c.accepted_beyond[i] += 1
                    name = r.source or "unknown"
                    c.drafter_steps[name] = c.drafter_steps.get(name, 0) + 1

    def record_request(self, tenant: str) -> None:
        with self._lock:
            self._counts.setdefault(tenant, _Counts()).num_requests += 1

    def forget(self, tenant: str) -> None:
        with self._lock:
            self._counts.pop(tenant, None)
        if self._holdout is not None:
            self._holdout.forget(tenant)

    def stats(self, tenant: str, index_resident: bool = True, **index_figures: int) -> TenantStats:
        """The tenant's figures; ``index_figures`` (index_tokens, ...) come from its index, when it is in
        memory (``index_resident``)."""
        if self._prefix_cache is not None:
            cached = self._prefix_cache.scope_stats(tenant)
            index_figures |= {"prefix_cache_bytes": cached.bytes, "prompt_tokens": cached.query_tokens,
                              "cached_prompt_tokens": cached.hit_tokens}
        if self.refresh is not None:  # `reprise index stats` right after a request counts it
            try:
                self.refresh()
            except Exception:
                log.debug("refreshing the figures failed", exc_info=True)
        with self._lock:
            c = self._counts.get(tenant) or _Counts()
            last = max((i + 1 for i, n in enumerate(c.accepted_beyond) if n), default=0)
            by_pos = tuple(n / c.num_drafted_steps for n in c.accepted_beyond[:last]) if c.num_drafted_steps else ()
            return TenantStats(
                tenant_id=tenant, num_requests=c.num_requests, num_steps=c.num_steps,
                num_drafted_steps=c.num_drafted_steps, num_draft_tokens=c.num_draft_tokens,
                num_accepted_tokens=c.num_accepted_tokens, acceptance_by_position=by_pos,
                drafter_steps=dict(c.drafter_steps), counting_since_unix_ms=self.since_unix_ms,
                index_resident=index_resident, savings=c.savings,
                measured=self._holdout.figures(tenant) if self._holdout is not None else MeasuredSpeedup(),
                **index_figures)


class StepMeter:
    """The engine's ``StepObserver``: per-tenant accounting and the Prometheus drafting figures."""

    def __init__(self, accounting: TenantAccounting, metrics: Any = None) -> None:
        self.accounting = accounting
        self.metrics = metrics

    def on_step(self, reports: Sequence[StepReport]) -> None:
        self.accounting.record_steps(reports)
        if self.metrics is not None:
            for r in reports:
                self.metrics.observe_step(r.num_draft, r.num_accepted, r.propose_seconds,
                                          r.match_len if r.propose_seconds is not None else None,
                                          skipped=not r.speculated)
                self.metrics.observe_costs(r.cost, r.prefill)

    def on_finish(self, result: GenerationResult) -> None:
        self.accounting.record_request(result.request.tenant)
