"""Replies that wait for their turn to be stored: what every decode backend does before a recorded
request's final event goes out, so that a completion a client has seen is in the history store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from serving import errors

#: How long a reply waits for the store before the request fails (a store that slow is down).
STORE_WAIT_S = 30.0


async def wait_stored(ticket: Any, timeout_s: float = STORE_WAIT_S,
                      on_wait: Callable[[float], None] | None = None) -> None:
    """Wait for a history writer's ``WriteTicket`` (None: nothing to store) without holding a thread:
    the ticket's callback resolves a future on this event loop. The writer's group commit makes the
    wait one commit at most; a turn that cannot be stored fails the request (UNAVAILABLE, the client
    retries) rather than be answered and lost. ``on_wait`` receives the seconds waited (metrics: what
    durability costs each reply)."""
    if ticket is None:
        return
    loop = asyncio.get_running_loop()
    stored: asyncio.Future[None] = loop.create_future()

    def resolved() -> None:
        if not stored.done():
            stored.set_result(None)

    def from_writer() -> None:  # the writer's thread
        try:
            loop.call_soon_threadsafe(resolved)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    t0 = time.perf_counter()
    ticket.add_done_callback(from_writer)
    try:
        await asyncio.wait_for(stored, timeout_s)
    except asyncio.TimeoutError:
        raise errors.Unavailable(f"the turn could not be stored within {timeout_s:.0f} s "
                                 "(the history store is slow or down); retry") from None
    finally:
        if on_wait is not None:
            on_wait(time.perf_counter() - t0)
    if not ticket.ok:
        raise errors.Unavailable(f"the turn could not be stored ({ticket.error}); retry")
