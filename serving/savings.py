"""What Reprise saves a tenant: the seconds its work took against an estimate of the same work without
Reprise (no drafts, no prefix cache). The estimate is derived, not simulated: each engine already
measures what a step costs on its host (for the draft budget), and the arithmetic here turns that into
seconds per request per step.

- **decode**: a step's time is shared among its requests by their rows (one row for the committed
  token plus one per draft node verified: ``attribute_step``). Without drafts each token a request
  committed would have needed a plain step of the same batch size, whose cost the engine's fitted
  step cost gives: a request's plain seconds are ``tokens * plain_step(B) / B``. So a tenant's decode
  speedup is its tokens per verification step times the plain step's cost over the drafted step's, at
  the batch sizes its steps ran at. The own engine shares each step's measured time; vLLM's worker, which
  times only steady steps, prices every step on its fitted cost (``reprise/backends/vllm/step_cost.py``).
- **prefill**: the measured prefill time, and without the prefix cache that time plus what prefilling
  the cached tokens costs on the host at the measured price per token (``attribute_prefill``; the own
  engine only: vLLM's prefix cache is vLLM's own, a vLLM without Reprise has it too).

A tenant's ``Savings`` sums them; ``speedup`` = (plain decode + plain prefill) / (decode + prefill),
``seconds_saved`` the difference, split into drafts and cache. Both sides of every ratio are on the
engine's cost clock. Where no step cost has been measured yet, a step's plain estimate is its own time:
no saving is claimed rather than a guess. What this leaves out (a plain engine would have batched the
same requests differently: a request that drafts well leaves its batch early with drafts, late without)
and how far the estimate was from an A/B measurement on both engines is in docs/service.md ("What Reprise
saves"); ``serving.holdout`` measures instead, on a share of real requests decoded without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestCost:
    """One request's part of a step (or of its prefill): measured ``seconds`` and the ``plain_seconds``
    the same work would have taken without Reprise."""

    seconds: float
    plain_seconds: float


def attribute_step(step_seconds: float, rows: Sequence[int], tokens: Sequence[int],
                   plain_step_seconds: float | None) -> list[RequestCost]:
    """Each request's part of one step of ``len(rows)`` requests: ``rows[i]`` rows verified (1 + draft
    nodes), ``tokens[i]`` committed. ``plain_step_seconds``: the engine's cost of a step of one row per
    request at this batch size (None: not measured yet, and no saving is claimed)."""
    if len(rows) != len(tokens):
        raise ValueError(f"rows and tokens differ in length: {len(rows)} != {len(tokens)}")
    total_rows = sum(rows)
    return [share(step_seconds, r, total_rows, t, len(rows), plain_step_seconds) for r, t in zip(rows, tokens)]


def share(step_seconds: float, rows: int, total_rows: int, tokens: int, batch_size: int,
          plain_step_seconds: float | None) -> RequestCost:
    """One request's part of a step of ``batch_size`` requests and ``total_rows`` rows (``attribute_step``
    for an engine that sees one request at a time)."""
    seconds = step_seconds * rows / total_rows if total_rows > 0 else step_seconds / max(batch_size, 1)
    plain = seconds if plain_step_seconds is None else tokens * plain_step_seconds / max(batch_size, 1)
    return RequestCost(seconds, plain)


def attribute_prefill(seconds: float, cached_seconds: float | None) -> RequestCost:
    """A prefill that took ``seconds`` after some prompt tokens came from the prefix cache; without the
    cache, prefilling those would have cost ``cached_seconds`` more (None: not measured yet)."""
    return RequestCost(seconds, seconds + (cached_seconds or 0.0))


@dataclass(frozen=True, slots=True)
class Savings:
    """A tenant's (or an interval's) seconds with Reprise against the estimate without it."""

    decode_seconds: float = 0.0  # measured: the tenant's share of its steps
    plain_decode_seconds: float = 0.0  # derived: one plain step per token, at the batch size it ran in
    prefill_seconds: float = 0.0  # measured
    plain_prefill_seconds: float = 0.0  # derived: the prefill plus the price of prefilling its cached tokens
    num_tokens: int = 0  # tokens committed in those steps

    def add_step(self, cost: RequestCost, num_tokens: int) -> Savings:
        return Savings(self.decode_seconds + cost.seconds, self.plain_decode_seconds + cost.plain_seconds,
                       self.prefill_seconds, self.plain_prefill_seconds, self.num_tokens + num_tokens)

    def add_prefill(self, cost: RequestCost) -> Savings:
        return Savings(self.decode_seconds, self.plain_decode_seconds, self.prefill_seconds + cost.seconds,
                       self.plain_prefill_seconds + cost.plain_seconds, self.num_tokens)

    def __add__(self, other: Savings) -> Savings:
        """Two tenants' (or two runs') figures together."""
        return Savings(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: Savings) -> Savings:
        """The figures between two cumulative samples (an interval)."""
        return Savings(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    @property
    def seconds(self) -> float:
        """Seconds spent, measured."""
        return self.decode_seconds + self.prefill_seconds

    @property
    def plain_seconds(self) -> float:
        """Seconds the same work would have taken without drafts and the prefix cache, estimated."""
        return self.plain_decode_seconds + self.plain_prefill_seconds

    @property
    def speedup(self) -> float | None:
        """Plain seconds over seconds spent (None before any)."""
        return self.plain_seconds / self.seconds if self.seconds > 0 else None

    @property
    def seconds_saved_drafts(self) -> float:
        return self.plain_decode_seconds - self.decode_seconds

    @property
    def seconds_saved_cache(self) -> float:
        return self.plain_prefill_seconds - self.prefill_seconds

    @property
    def seconds_saved(self) -> float:
        return self.plain_seconds - self.seconds

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens delivered per second spent (None before any)."""
        return self.num_tokens / self.seconds if self.seconds > 0 else None

    def figures(self) -> dict[str, Any]:
        """The derived figures as plain values (the dashboard's and the CLI's JSON)."""
        return {"speedup": self.speedup, "seconds_saved": self.seconds_saved,
                "seconds_saved_drafts": self.seconds_saved_drafts, "seconds_saved_cache": self.seconds_saved_cache,
                "seconds": self.seconds, "plain_seconds": self.plain_seconds,
                "tokens_per_second": self.tokens_per_second}
