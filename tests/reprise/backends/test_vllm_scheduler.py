"""The fair-share rules applied to vLLM's scheduler queues (reprise/backends/vllm/scheduler.py), on vLLM's
own queue and status types with a stand-in for the rest of the scheduler; the real engine's behaviour is
tested in test_vllm_engine.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from reprise.backends.vllm.tags import RequestTag
from reprise.backends.vllm.versions import VllmUnavailableError, require_vllm

try:
    require_vllm()
    _SKIP = ""
except VllmUnavailableError as exc:
    _SKIP = str(exc)

pytestmark = pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "vLLM installed")


@dataclass
class Params:
    extra_args: dict[str, Any] | None


@dataclass(eq=False)
class Req:
    request_id: str
    sampling_params: Params
    status: Any


@dataclass
class Stand:
    """What ``share_slots`` reads and calls of vLLM's ``Scheduler``: its queues, its slot count, its
    policy, and a ``_preempt_request`` that does what vLLM's does to the queues."""

    max_num_running_reqs: int
    policy: Any = None
    running: list[Req] = field(default_factory=list)
    waiting: Any = None
    preempted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy

        self.policy = self.policy or SchedulingPolicy.FCFS
        self.waiting = FCFSRequestQueue()

    def _request_blocks_can_be_freed(self, request: Req) -> bool:
        return True

    def _preempt_request(self, request: Req, timestamp: float) -> None:
        from vllm.v1.request import RequestStatus

        assert request.status == RequestStatus.RUNNING and request not in self.running
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend_request(request)
        self.preempted.append(request.request_id)


def req(name: str, tenant: str | None, status: str = "WAITING") -> Req:
    from vllm.v1.request import RequestStatus

    extra = RequestTag(tenant).to_extra_args() if tenant else None
    return Req(name, Params(extra), RequestStatus[status])


def stand(slots: int, running: list[tuple[str, str | None]], waiting: list[tuple[str, str | None]]) -> Stand:
    s = Stand(slots)
    s.running = [req(name, tenant, "RUNNING") for name, tenant in running]
    for name, tenant in waiting:
        s.waiting.add_request(req(name, tenant))
    return s


def ids(queue: Any) -> list[str]:
    return [r.request_id for r in queue]


def test_the_tenant_holding_every_slot_yields_its_newest_and_the_waiting_tenant_goes_first() -> None:
    from reprise.backends.vllm.scheduler import share_slots

    s = stand(4, [(f"a{i}", "A") for i in range(4)], [("a4", "A"), ("a5", "A"), ("b0", "B")])
    assert share_slots(s) == 1
    assert s.preempted == ["a3"] and ids(s.running) == ["a0", "a1", "a2"]
    assert ids(s.waiting) == ["b0", "a3", "a4", "a5"]  # the yielded request first among A's


def test_slots_are_shared_evenly_as_the_waiting_tenants_allow() -> None:
    from reprise.backends.vllm.scheduler import share_slots

    s = stand(8, [(f"a{i}", "A") for i in range(8)], [(f"b{i}", "B") for i in range(6)] + [("c0", "C")])
    assert share_slots(s) == 4  # A 8 -> 4: C takes 1, B 3 (one fewer than A: as even as it gets)
    assert s.preempted == ["a7", "a6", "a5", "a4"]
    assert ids(s.waiting)[:5] == ["b0", "c0", "b1", "b2", "b3"]
    s = stand(4, [("a0", "A"), ("a1", "A"), ("b0", "B"), ("b1", "B")], [("a2", "A"), ("b2", "B")])
    assert share_slots(s) == 0 and ids(s.waiting) == ["a2", "b2"]


def test_nothing_yields_while_a_slot_is_free_or_to_a_request_not_ready() -> None:
    from reprise.backends.vllm.scheduler import share_slots

    s = stand(4, [("a0", "A"), ("a1", "A"), ("a2", "A")], [("a3", "A"), ("b0", "B")])
    assert share_slots(s) == 0 and ids(s.waiting) == ["b0", "a3"]  # the free slot goes to B
    s = stand(2, [("a0", "A"), ("a1", "A")], [])
    s.waiting.add_request(req("b0", "B", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"))  # its grammar compiles
    assert share_slots(s) == 0


def test_untagged_requests_are_one_tenant_and_priorities_are_left_to_the_operator() -> None:
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    from reprise.backends.vllm.scheduler import share_slots

    s = stand(2, [("x0", None), ("x1", None)], [("b0", "B")])
    assert share_slots(s) == 1 and s.preempted == ["x1"]
    s = stand(2, [("a0", "A"), ("a1", "A")], [("b0", "B")])
    s.policy = SchedulingPolicy.PRIORITY
    assert share_slots(s) == 0


def test_the_engine_is_built_with_the_fair_share_scheduler_of_vllms_kind() -> None:
    from reprise.backends.vllm.engine import SCHEDULERS
    from reprise.backends.vllm.scheduler import FairShareAsyncScheduler, FairShareScheduler

    assert SCHEDULERS == {False: f"{FairShareScheduler.__module__}.{FairShareScheduler.__name__}",
                          True: f"{FairShareAsyncScheduler.__module__}.{FairShareAsyncScheduler.__name__}"}
