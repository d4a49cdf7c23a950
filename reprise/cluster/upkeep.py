"""The replica's two background threads: the feed listener and the upkeep loop.

- ``FeedListener`` blocks on the change feed (one XREAD for every tenant) and hands each event to the
  replica: another replica's append -> ``catch_up`` (if the tenant is held and behind); a deletion ->
  ``tenant_deleted``; rotated keys -> ``keys_changed``; a replaced corpus or rebuilt index -> evict (it
  reloads on next use); a new snapshot -> the tenant's tail restarts from it. While Redis is unreachable
  it retries with backoff; when Redis is back it resyncs every held tenant (events may have been lost).
- ``Upkeep`` seals snapshots that are due and keeps the memory budget (every ``snapshot_check_s``),
  resyncs (``resync_interval_s``) and cleans up after deletions that raced this replica's writes. Snapshots are sealed here, never on the
  engine thread, so decoding does not wait for them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from privacy import changefeed as cf
from privacy.errors import StorageError
from privacy.tenants import TenantId

log = logging.getLogger(__name__)


class FeedListener:
    """Applies the change feed to a ``Replica`` on its own thread."""

    def __init__(self, replica: Any, feed: Any, block_ms: int = 1000) -> None:
        self.replica = replica
        self.feed = feed
        self.block_ms = block_ms
        self.after = "0-0"
        self.num_events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reprise-feed", daemon=True)

    def start(self) -> None:
        """Listen from the feed's current end (everything earlier is in the stream a load reads)."""
        self.after = self.feed.last_id()
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop listening (``wait``: until the blocked read returns, at most ``block_ms``)."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(self.block_ms / 1000 + 5)

    def _run(self) -> None:
        backoff, down = 0.05, False
        while not self._stop.is_set():
            try:
                events = self.feed.read(self.after, self.block_ms)
                if down:
                    log.warning("the change feed is reachable again; resyncing held tenants")
                    self.replica.resync()
                    down, backoff = False, 0.05
            except StorageError as exc:
                if not down:
                    log.warning("the change feed is unreachable (%s); retrying", exc)
                    down = True
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            except Exception:
                log.exception("change feed listener error")
                self._stop.wait(1.0)
                continue
            for event in events:
                self.after = event.id
                self.num_events += 1
                try:
                    self.handle(event)
                except StorageError:
                    down = True  # resync once the store answers again
                except Exception:
                    log.exception("could not apply change feed event %s", event)

    def handle(self, event: Any) -> None:
        """Apply one ``privacy.changefeed.FeedEvent``."""
        try:
            TenantId(event.tenant)
        except ValueError:
            log.warning("ignored a change feed event for a malformed tenant id %r", event.tenant[:80])
            return
        r, tenant, mine = self.replica, event.tenant, event.origin == self.replica.name
        if event.kind == cf.KIND_APPEND and not mine:  # this replica applied its own appends already
            cursor = r.cursor(tenant)
            if cursor is not None and cf.stream_position(event.cursor) > cf.stream_position(cursor):
                r.catch_up(tenant)
        elif event.kind == cf.KIND_DELETE:
            r.tenant_deleted(tenant)
        elif event.kind == cf.KIND_KEYS and not mine:
            r.keys_changed(tenant)
        elif event.kind == cf.KIND_RELOAD and not mine:
            r.evict(tenant)
        elif event.kind == cf.KIND_SNAPSHOT and not mine:
            r.snapshot_seen(tenant)


class Upkeep:
    """Snapshots, resyncs and leftover cleanup for a ``Replica`` on its own thread."""

    def __init__(self, replica: Any, snapshot_check_s: float, resync_interval_s: float) -> None:
        self.replica = replica
        self.snapshot_check_s = snapshot_check_s
        self.resync_interval_s = resync_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reprise-upkeep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        next_resync = time.monotonic() + self.resync_interval_s
        down = False
        while not self._stop.wait(min(self.snapshot_check_s, self.resync_interval_s)):
            try:
                self.replica.compact()
                self.replica.enforce_budget()  # held indexes also grow by catching up
                self.replica.purge_leftovers()
                if time.monotonic() >= next_resync:
                    next_resync = time.monotonic() + self.resync_interval_s
                    self.replica.resync()
                down = False
            except StorageError as exc:
                if not down:
                    log.warning("replica upkeep postponed while the store is unavailable (%s)", exc)
                down = True
            except Exception:
                log.exception("replica upkeep failed; retrying")
