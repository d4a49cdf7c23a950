"""Fair share of vLLM's decoding slots between tenants: vLLM's scheduler with the own engine's two rules.

vLLM 0.32.0's scheduler admits waiting requests from the head of one queue, first come first served,
and preempts a running request only when KV blocks run short: a tenant whose requests reach the queue
first holds every slot (``max_num_seqs``) until they end, however long, while another tenant's request
waits behind them. ``SchedulerConfig.scheduler_cls`` is vLLM's place for another scheduler, so the
engine is built with a subclass (``VllmEngine``) that, before each ``schedule``, applies the rules of
reprise/engine/fair_share.py to the request queues and leaves the scheduling itself to vLLM:

- **yield**: while every slot is taken and a tenant waits holding at least two slots fewer than the
  tenant holding the most, that tenant's newest running request is preempted by vLLM's own
  ``_preempt_request`` (what it does under KV pressure): its blocks go back to the pool, their hashes
  kept, and when it resumes vLLM recomputes its KV through the prefix cache (its tenant's salt, so only
  its own blocks); its sampling generator stays in the worker and its drafting session in Reprise's
  proposer, so its output is what it would have been;
- **order**: the waiting queue is put in the order ``fair_share.next_waiting`` admits: the oldest request
  of the tenant holding the fewest slots first (a preempted request is the oldest of its tenant's).

A request's tenant is its ``RequestTag`` (``SamplingParams.extra_args["reprise"]``, written by the service
after authentication); requests without one count as one tenant. With vLLM's ``priority`` policy the
queue is the operator's priorities and is left alone. The scheduler's attributes read here (``running``,
``waiting``, ``max_num_running_reqs``, ``policy``, ``_preempt_request``, ``_request_blocks_can_be_freed``)
are vLLM internals: ``versions.py`` pins the version they were read from.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from reprise.backends.vllm.tags import RequestTag
from reprise.engine.fair_share import admission_order, next_waiting, yielding_tenant

log = logging.getLogger(__name__)

READY = (RequestStatus.WAITING, RequestStatus.PREEMPTED)  # waiting requests the scheduler may admit now


def tenant_of(request: Any) -> str:
    """The tenant a vLLM request decodes for ("" without a tag)."""
    params = getattr(request, "sampling_params", None)
    tag = RequestTag.from_extra_args(getattr(params, "extra_args", None))
    return tag.tenant if tag is not None else ""


def share_slots(scheduler: Any) -> int:
    """Apply the fair-share rules to ``scheduler``'s queues (module docstring); returns how many running
    requests yielded their slot."""
    if scheduler.policy != SchedulingPolicy.FCFS or not scheduler.waiting:
        return 0
    held = Counter(tenant_of(r) for r in scheduler.running)
    yielded = _yield_slots(scheduler, held)
    queued = list(scheduler.waiting)
    tenants = [tenant_of(r) for r in queued]
    if len(set(tenants)) > 1:
        scheduler.waiting.clear()
        scheduler.waiting.extend(queued[i] for i in admission_order(held, tenants))
    return yielded


def _yield_slots(scheduler: Any, held: Counter[str]) -> int:
    """Preempt as the own engine's admission loop does (``Engine._admit``): free slots go to the waiting
    tenants in fair order (as vLLM will admit them from the ordered queue this step), and where every
    slot is taken the tenant ``yielding_tenant`` names yields its newest running request; until neither
    applies. ``held`` (slots per tenant) loses the yielded ones. Returns how many yielded."""
    admitted = Counter(held)  # held, and what this step's admissions will add
    ready = [tenant_of(r) for r in scheduler.waiting if r.status in READY]
    free = scheduler.max_num_running_reqs - len(scheduler.running)
    yielded = 0
    while ready:
        if free > 0:
            admitted[ready.pop(next_waiting(admitted, ready))] += 1
            free -= 1
            continue
        tenant = yielding_tenant(admitted, ready)
        if tenant is None:
            break
        victim = next((r for r in reversed(scheduler.running) if tenant_of(r) == tenant), None)
        if victim is None or not scheduler._request_blocks_can_be_freed(victim):
            break
        scheduler.running.remove(victim)
        scheduler._preempt_request(victim, time.monotonic())  # to the head of the waiting queue
        held[tenant] -= 1
        admitted[tenant] -= 1
        ready.insert(0, tenant)
        free += 1
        yielded += 1
    return yielded


class FairShareScheduler(Scheduler):
    """vLLM's scheduler (the one it runs with Reprise's proposer: no async scheduling) with fair shares."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        _share_slots_safely(self)
        return super().schedule(*args, **kwargs)


class FairShareAsyncScheduler(AsyncScheduler):
    """vLLM's asynchronous scheduler (its default where no speculation rules it out) with fair shares."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        _share_slots_safely(self)
        return super().schedule(*args, **kwargs)


def _share_slots_safely(scheduler: Any) -> None:
    """``share_slots``, whose failure costs the fairness of one step, never the step (logged once)."""
    try:
        share_slots(scheduler)
    except Exception:
        if not getattr(scheduler, "_reprise_share_failed", False):
            scheduler._reprise_share_failed = True
            log.exception("fair share of slots failed; vLLM schedules first come first served this step")

