"""Fair share of decoding slots between tenants: who gets the next free slot, and who yields one.

Both engines decide with these two functions (the own engine in ``Engine._admit``, vLLM's scheduler in
``reprise/backends/vllm/scheduler.py``), so a tenant's share means the same on either:

- **admission**: a free slot goes to the waiting request of the tenant holding the fewest slots, the
  oldest among that tenant's (``next_waiting``);
- **preemption**: when every slot is taken and a tenant waits, the tenant holding the most slots yields
  one (its newest request goes back to waiting, whole, and resumes later) if it holds at least two more
  than the waiting tenant holding the fewest (``yielding_tenant``).

Together they converge to max-min fair shares of the slots: ``num_slots / n`` each for ``n`` tenants
that all have work waiting, and what a tenant does not use goes to the others. The "two more" keeps
preemption from going round in circles: after a yield the two tenants differ by at least one slot in
the same direction, so the one that yielded never takes the slot back while the other still waits,
and every yield lowers the sum of squared holdings, so a burst of them ends. A tenant that waits
holding no slot gets one at the next step whenever some tenant holds two or more (with more tenants
than slots, each holding one, it waits for the first to end, as every other tenant does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def next_waiting(held: Mapping[str, int], waiting: Sequence[str]) -> int:
    """The index in ``waiting`` (the waiting requests' tenants, oldest first) of the request that takes
    the next free slot: the oldest of the tenant holding the fewest slots (``held``: slots per tenant)."""
    if not waiting:
        raise ValueError("no request is waiting")
    return min(range(len(waiting)), key=lambda i: held.get(waiting[i], 0))


def yielding_tenant(held: Mapping[str, int], waiting: Iterable[str]) -> str | None:
    """The tenant that yields a slot now that every slot is taken (``held``: slots per tenant;
    ``waiting``: the tenants of requests waiting for one): the tenant holding the most slots, when it
    holds at least two more than the waiting tenant holding the fewest; None otherwise."""
    fewest = min((held.get(tenant, 0) for tenant in waiting), default=None)
    if fewest is None or not held:
        return None
    most = max(held, key=lambda tenant: held[tenant])
    return most if held[most] >= fewest + 2 else None


def admission_order(held: Mapping[str, int], waiting: Sequence[str]) -> list[int]:
    """Every index of ``waiting`` in the order ``next_waiting`` would admit them, each admission
    counted as a slot held (for a scheduler that admits from the head of a queue)."""
    held = dict(held)
    left = list(range(len(waiting)))
    order = []
    while left:
        pick = left.pop(next_waiting(held, [waiting[i] for i in left]))
        held[waiting[pick]] = held.get(waiting[pick], 0) + 1
        order.append(pick)
    return order
