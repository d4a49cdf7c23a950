"""Replies that wait for their turn to be stored: what every decode backend does before a recorded
request's final message goes out, so that a completion a client has seen is in the history store."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from grpc_api import errors

#: How long a reply waits for the store before the request fails (a store that slow is down).
STORE_WAIT_S = 30.0


def await_stored(ticket: Any, timeout_s: float = STORE_WAIT_S,
                 on_wait: Callable[[float], None] | None = None) -> None:
    """Wait for a history writer's ``WriteTicket`` (None: nothing to store). The writer's group commit
    makes the wait one commit at most; a turn that cannot be stored fails the request (UNAVAILABLE, the
    client retries) rather than be answered and lost. ``on_wait`` receives the seconds waited (metrics:
    what durability costs each reply)."""
    if ticket is None:
        return
    t0 = time.perf_counter()
    stored = ticket.wait(timeout_s)
    if on_wait is not None:
        on_wait(time.perf_counter() - t0)
    if not stored:
        raise errors.Unavailable(f"the turn could not be stored within {timeout_s:.0f} s "
                                 "(the history store is slow or down); retry")
    if not ticket.ok:
        raise errors.Unavailable(f"the turn could not be stored ({ticket.error}); retry")
