"""Per-tenant quotas on ``AppendTrajectory``: how often a tenant may add turns to its history, and how
many tokens per minute. Each is a token bucket: ``capacity`` units refilled at ``rate`` per second; a
call that finds too little in it is refused and told when enough will be there.

    quotas = AppendQuotas(calls_per_s=20, burst_calls=100, tokens_per_minute=1_000_000)
    quotas.admit_call(tenant)             # before any work on the call: ResourceExhausted with retry_after_s
    quotas.admit_tokens(tenant, n)        # once the turn's token count is known

Generation requests are bounded elsewhere (admission: requests in flight; max_new_tokens; the context):
this bounds the one call that writes history without decoding. A call refused for its size still
counts as a call but takes no tokens, so a client that waits the hinted delay gets through. Runs on the event loop (no lock needed); the clock is
monotonic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from serving import errors

_MAX_TENANTS = 100_000  # buckets kept; full ones are dropped first (a full bucket is the default state)


@dataclass(slots=True)
class TokenBucket:
    """``level`` units available now (at most ``capacity``), refilled at ``rate`` per second."""

    capacity: float
    rate: float
    level: float
    updated: float

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if there is that much: 0.0. Else take nothing and return the seconds until
        there will be (``inf`` when ``amount`` exceeds the capacity: it never fits)."""
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate


class AppendQuotas:
    """The call-rate and token-rate buckets of every tenant (0 in a setting: that quota is off)."""

    def __init__(self, calls_per_s: float, burst_calls: int, tokens_per_minute: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[str], None] | None = None) -> None:
        if calls_per_s < 0 or burst_calls < 0 or tokens_per_minute < 0:
            raise ValueError(f"append quotas must be >= 0, got calls_per_s={calls_per_s}, "
                             f"burst_calls={burst_calls}, tokens_per_minute={tokens_per_minute}")
        if calls_per_s and burst_calls < 1:
            raise ValueError(f"append burst_calls must be >= 1 when calls_per_s is set, got {burst_calls}")
        self.calls_per_s = calls_per_s
        self.burst_calls = burst_calls
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._on_refused = on_refused
        self._calls: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def admit_call(self, tenant: str) -> None:
        """Count one call; ResourceExhausted (with the delay until one fits) past the tenant's rate."""
        if not self.calls_per_s:
            return
        wait = self._bucket(self._calls, tenant, self.burst_calls, self.calls_per_s).take(1, self._clock())
        if wait:
            self._refused("calls")
            raise errors.ResourceExhausted(
                f"AppendTrajectory rate quota: at most {self.calls_per_s:g} calls per second per tenant "
                f"(bursts of {self.burst_calls}); retry in {wait:.2f} s", retry_after_s=wait)

    def admit_tokens(self, tenant: str, num_tokens: int, field: str | None = None) -> None:
        """Count a turn's tokens; ResourceExhausted past the tenant's tokens per minute (with the delay
        until it fits, or, for a turn larger than a whole minute's quota, saying it never will)."""
        if not self.tokens_per_minute or num_tokens <= 0:
            return
        bucket = self._bucket(self._tokens, tenant, self.tokens_per_minute, self.tokens_per_minute / 60)
        wait = bucket.take(num_tokens, self._clock())
        if not wait:
            return
        self._refused("tokens")
        if math.isinf(wait):
            raise errors.ResourceExhausted(
                f"AppendTrajectory size quota: this turn has {num_tokens} tokens, more than a tenant may add in "
                f"a minute ({self.tokens_per_minute}); split it", retry_after_s=60.0, param=field)
        raise errors.ResourceExhausted(
            f"AppendTrajectory size quota: at most {self.tokens_per_minute} tokens per minute per tenant; this "
            f"turn of {num_tokens} tokens fits in {wait:.1f} s", retry_after_s=wait, param=field)

    def _bucket(self, buckets: dict[str, TokenBucket], tenant: str, capacity: float, rate: float) -> TokenBucket:
        bucket = buckets.get(tenant)
        if bucket is None:
            if len(buckets) >= _MAX_TENANTS:
                self._prune(buckets)
            bucket = buckets[tenant] = TokenBucket(capacity, rate, capacity, self._clock())
        return bucket

    def _prune(self, buckets: dict[str, TokenBucket]) -> None:
        """Drop the buckets that have refilled (they equal a new one)."""
        now = self._clock()
        for tenant in [t for t, b in buckets.items() if b.level + (now - b.updated) * b.rate >= b.capacity]:
            del buckets[tenant]

    def _refused(self, quota: str) -> None:
        if self._on_refused is not None:
            self._on_refused(quota)
