"""What crosses between the service process and vLLM's worker: the request tag and the step records.

Both are plain values (dicts, lists, ints, bytes): vLLM carries ``SamplingParams.extra_args`` and
``collective_rpc`` arguments through its own serialisation, which takes plain values without pickling.

The tag is set by the service after authentication (``VllmBackend.generate``); a client never writes
it: the data plane takes no extra args from requests, and the service overwrites the whole key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXTRA_ARGS_KEY = "reprise"  # SamplingParams.extra_args[EXTRA_ARGS_KEY] holds the request's tag


@dataclass(frozen=True, slots=True)
class RequestTag:
    """Who a request drafts for: its tenant and session, and whether it drafts at all."""

    tenant: str
    session_id: str = ""
    speculate: bool = True

    def to_extra_args(self) -> dict[str, Any]:
        return {EXTRA_ARGS_KEY: {"tenant": self.tenant, "session": self.session_id, "speculate": self.speculate}}

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None) -> RequestTag | None:
        """The tag in a request's extra args, or None when it has none (such a request drafts nothing:
        without a tenant there is no history it may draft from)."""
        raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
        if not isinstance(raw, dict) or not isinstance(raw.get("tenant"), str) or not raw["tenant"]:
            return None
        return cls(raw["tenant"], str(raw.get("session") or ""), bool(raw.get("speculate", True)))


StepWire = tuple[str, int, int, str, int, float, float]  # a StepRecord as vLLM's RPC carries it


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of one request, as the worker saw it: the draft it verified (its length and drafter),
    how many of its tokens were accepted, the tokens it delivered, and, once the worker's step cost is
    fitted, the request's share of the step's seconds against what its tokens would have cost in plain
    steps of the same batch size (serving/savings.py; 0 and 0 before that)."""

    tenant: str
    num_draft: int
    num_accepted: int
    source: str
    num_tokens: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0

    def to_wire(self) -> StepWire:
        return (self.tenant, self.num_draft, self.num_accepted, self.source, self.num_tokens, self.seconds,
                self.plain_seconds)

    @classmethod
    def from_wire(cls, raw: Any) -> StepRecord:
        tenant, num_draft, num_accepted, source, num_tokens, seconds, plain_seconds = raw
        return cls(str(tenant), int(num_draft), int(num_accepted), str(source), int(num_tokens), float(seconds),
                   float(plain_seconds))
