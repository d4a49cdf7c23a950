"""Per-tenant statistics over time, for the dashboard page.

A background thread samples every tenant's cumulative figures (``AdminBackend.index_stats``) every
``interval_s`` seconds and keeps the last ``max_samples``; the page's series are the differences between
successive samples: hit rate, tau, drafter mix and speedup (serving/savings.py) *in each interval*, so a change shows at once instead
of being averaged into the tenant's whole past. Only aggregates are kept, never tokens or text, and a
deleted tenant's samples are dropped with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.admin import TenantInfo, TenantStats
from serving.savings import Savings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # Unix seconds
    stats: TenantStats


def interval_point(prev: TenantStats | None, cur: TenantStats, t: float) -> dict[str, Any]:
    """Figures of the interval between two cumulative samples (None where the tenant ran no step)."""
    saved = cur.savings - (prev.savings if prev else Savings())
    steps = cur.num_steps - (prev.num_steps if prev else 0)
    drafted = cur.num_drafted_steps - (prev.num_drafted_steps if prev else 0)
    accepted = cur.num_accepted_tokens - (prev.num_accepted_tokens if prev else 0)
    mix: dict[str, float] = {}
    if drafted > 0:
        before = prev.drafter_steps if prev else {}
        for name, n in cur.drafter_steps.items():
            d = n - before.get(name, 0)
            if d > 0:
                mix[name] = d / drafted
    return {
        "t": int(t * 1000),
        "steps": steps,
        "hit_rate": drafted / steps if steps > 0 else None,
        "tau": (accepted + steps) / steps if steps > 0 else None,
        "drafter_mix": mix,
        "index_tokens": cur.index_tokens,
        "speedup": saved.speedup if steps > 0 else None,
        "seconds_saved": saved.seconds_saved,
        "tokens_per_second": saved.tokens_per_second if steps > 0 else None,
    }


def stats_json(s: TenantStats) -> dict[str, Any]:
    return {
        "index_tokens": s.index_tokens, "index_sequences": s.index_sequences,
        "index_memory_bytes": s.index_memory_bytes, "corpus_tokens": s.corpus_tokens,
        "num_requests": s.num_requests, "num_steps": s.num_steps, "num_drafted_steps": s.num_drafted_steps,
        "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
        "hit_rate": s.hit_rate, "tau": s.tau, "acceptance_by_position": list(s.acceptance_by_position),
        "drafter_steps": dict(s.drafter_steps), "counting_since_unix_ms": s.counting_since_unix_ms,
        "prefix_cache_bytes": s.prefix_cache_bytes, "prompt_tokens": s.prompt_tokens,
        "cached_prompt_tokens": s.cached_prompt_tokens, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        **s.savings.figures(),
    }


class StatsHistory:
    """Samples of every tenant's statistics; ``snapshot()`` is the dashboard's JSON document."""

    def __init__(self, stats: Callable[[], list[TenantStats]], tenants: Callable[[], list[TenantInfo]],
                 interval_s: float = 10.0, max_samples: int = 360) -> None:
        self._stats = stats
        self._tenants = tenants
        self.interval_s = interval_s
        self._samples: dict[str, deque[Sample]] = {}
        self._names: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.max_samples = max_samples

    def sample(self, now: float | None = None) -> None:
        """Take one sample of every tenant (also called by the thread)."""
        now = time.time() if now is None else now
        stats = self._stats()
        names = {t.tenant_id: t.name for t in self._tenants()}
        with self._lock:
            self._names = names
            for s in stats:
                self._samples.setdefault(s.tenant_id, deque(maxlen=self.max_samples)).append(Sample(now, s))
            for gone in set(self._samples) - {s.tenant_id for s in stats}:
                del self._samples[gone]

    def forget(self, tenant_id: str) -> None:
        with self._lock:
            self._samples.pop(tenant_id, None)
            self._names.pop(tenant_id, None)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            tenants: list[dict[str, Any]] = []
            since = 0
            for tid, samples in sorted(self._samples.items(), key=lambda kv: self._names.get(kv[0], kv[0])):
                items = list(samples)
                series = [interval_point(items[i - 1].stats if i else None, s.stats, s.t)
                          for i, s in enumerate(items)][1:]  # the first sample only anchors the deltas
                tenants.append({"tenant_id": tid, "name": self._names.get(tid, ""),
                                "current": stats_json(items[-1].stats), "series": series})
                since = min(since or items[-1].stats.counting_since_unix_ms, items[-1].stats.counting_since_unix_ms)
        return {"generated_at": int(time.time() * 1000), "interval_s": self.interval_s, "tenants": tenants,
                "counting_since_unix_ms": since}

    def start(self) -> None:
        if self._thread is not None:
            return

        def run() -> None:
            while True:
                try:
                    self.sample()
                except Exception:
                    log.exception("dashboard: sampling tenant statistics failed")
                if self._stop.wait(self.interval_s):
                    return

        self._thread = threading.Thread(target=run, name="reprise-stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
