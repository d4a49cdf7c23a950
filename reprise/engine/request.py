"""The finished turn: ``GenerationResult``, the one record of a turn from the engine to the history sink
and the step observer (vLLM's backend makes the same one). What was asked is the serving core's request
record (``serving.records.Request``), which both engines decode; finish reasons and usage are the serving
core's records too."""

from __future__ import annotations

from dataclasses import dataclass

from serving.records import FinishReason, Request, Usage


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished turn: the request and what it produced. ``finish_reason``: ``length`` (max_new_tokens
    or the context), ``stop`` (a stop token or string; ``matched_stop`` says which), ``eos`` (the model's
    end of sequence, ``matched_stop`` its id), ``aborted`` (cancelled) or ``error`` (the engine failed
    it; ``RequestHandle.wait`` raises the error)."""

    request: Request
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    matched_stop: int | str | None
    usage: Usage

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def recorded(self) -> bool:
        """Whether this turn joins its tenant's history."""
        return self.request.params.record and self.finish_reason not in ("aborted", "error")
