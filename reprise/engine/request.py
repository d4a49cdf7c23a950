"""Records of one generation request: what was asked (``GenerationRequest``) and the finished turn
(``GenerationResult``: the request with what came out), which the backends answer from and the history
sink stores. Finish reasons and usage are the serving core's records (``serving.records``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serving.records import FinishReason, Usage
from verifier.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class StoppingParams:
    """When a request ends.

    ``max_new_tokens``: output tokens at most (finish reason ``length``; also when the context limit is
    reached). ``min_new_tokens``: EOS and ``stop_token_ids`` are banned until that many tokens exist
    (as transformers ``min_new_tokens`` does, by masking their logits). EOS ends the request unless
    ``ignore_eos``; a ``stop_token_ids`` token ends it too; both stay in ``token_ids``. ``stop_strings``
    are matched on the decoded text: the text ends before the first match (``include_stop_string``
    keeps the match itself), and tokens after the one completing the match are never emitted.
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_string: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request: prompt tokens, sampling and stopping, and whose history it reads and joins.

    ``speculate``: draft for this request (False decodes one token per step; the output is the same).
    ``record_history``: a finished turn joins the tenant's history (not when it was aborted or failed).
    ``grammar``: a ``reprise.engine.grammar.CheckedGrammar`` the output follows (``GrammarCompiler.compile``).
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    tenant: str = "default"
    session_id: str = ""
    request_id: str = ""
    record_history: bool = True
    speculate: bool = True
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty: at least one token is needed")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_ids):
            bad = next(t for t in self.prompt_ids if not isinstance(t, int) or t < 0)
            raise ValueError(f"prompt_ids must be non-negative ints, got {bad!r}")
        if not self.tenant:
            raise ValueError("tenant must be a non-empty string")


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished turn: the request and what it produced. ``finish_reason``: ``length`` (max_new_tokens
    or the context), ``stop`` (a stop token or string; ``matched_stop`` says which), ``eos`` (the model's
    end of sequence, ``matched_stop`` its id), ``aborted`` (cancelled) or ``error`` (the engine failed
    it; ``RequestHandle.wait`` raises the error)."""

    request: GenerationRequest
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
        return self.request.record_history and self.finish_reason not in ("aborted", "error")
