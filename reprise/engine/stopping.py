"""Stop conditions and incremental detokenization of one request's output.

``StopChecker.append(step_ids)`` takes the tokens a step committed and returns the ones to keep (cut
after a stop token, EOS, the token completing a stop string, or the length limit: the request's
``GenerateParams``, whose docstring says what each means), the text delta that
may be streamed now, and whether the request is finished. Text is decoded incrementally (re-decoding
only the tokens since the last newline, and holding back a trailing incomplete UTF-8 sequence); while
stop strings are set, the last ``len(longest stop) - 1`` characters are held back, so streamed text never
runs past a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.records import FinishReason, GenerateParams


def check_stopping(params: GenerateParams, tokenizer: Any) -> None:
    """What an engine needs of a request's stopping parameters (the serving core has validated a served
    request's; a request made without the service, such as offline replay's, is checked here):
    ``max_new_tokens`` set and at least 1, ``min_new_tokens`` within it, stop strings only with a tokenizer."""
    if params.max_new_tokens is None:
        raise ValueError("max_new_tokens is not set: the serving core sets it once the prompt is rendered; "
                         "a request made without the service gives it (Request.of_tokens)")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if not 0 <= params.min_new_tokens <= params.max_new_tokens:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={params.max_new_tokens}], "
                         f"got {params.min_new_tokens}")
    if any(t < 0 for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be >= 0, got {params.stop_token_ids}")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise ValueError(f"stop strings must be non-empty strings, got {params.stop!r}")
    if params.stop and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer; this engine has none")


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """Result of appending one step's tokens."""

    token_ids: list[int]  # the step's tokens that are kept
    text_delta: str  # text that may be streamed now
    finish_reason: FinishReason | None  # None while the request goes on
    matched_stop: int | str | None


class StopChecker:
    """Stop conditions of one request; ``tokenizer`` may be None (token ids only, no stop strings).
    ``max_new_tokens``: the request's, or fewer when the context left (``room``) holds fewer."""

    def __init__(self, params: GenerateParams, tokenizer: Any, eos_token_ids: Sequence[int], room: int) -> None:
        assert params.max_new_tokens is not None, "Engine.submit refuses a request without it (check_stopping)"
        self.params = params
        self.tokenizer = tokenizer
        self.max_new_tokens = min(params.max_new_tokens, room)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self._stop_ids = np.array(sorted(stops), dtype=np.int64)
        self._eos = set(eos_token_ids)
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._streamed = 0  # characters of self.text already handed out
        self._line_start = 0  # token index where the current decoded segment starts
        self._line_text_len = 0  # len(self.text) when the segment started

    def append(self, step_ids: Sequence[int]) -> StepOutcome:
        ids = [int(t) for t in step_ids]
        reason: FinishReason | None = None
        matched: int | str | None = None
        room = self.max_new_tokens - len(self.token_ids)
        if len(ids) >= room:
            ids, reason = ids[:room], "length"
        if len(self._stop_ids) and len(self.token_ids) + len(ids) > self.params.min_new_tokens:
            first_allowed = max(0, self.params.min_new_tokens - len(self.token_ids))
            hits = np.nonzero(np.isin(np.asarray(ids[first_allowed:], dtype=np.int64), self._stop_ids))[0]
            if len(hits):
                cut = first_allowed + int(hits[0])
                ids, matched = ids[: cut + 1], ids[cut]
                reason = "eos" if matched in self._eos and matched not in self.params.stop_token_ids else "stop"
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        if self.tokenizer is not None:
            self._decode(final=reason is not None)
            if self.params.stop:
                found = self._find_stop_string()
                if found is not None:
                    pos, stop = found
                    end = pos + (len(stop) if self.params.include_stop_str_in_output else 0)
                    keep = self._tokens_covering(start, pos + len(stop))
                    del self.token_ids[keep:]
                    ids = self.token_ids[start:]
                    self.text = self.text[:end]
                    reason, matched = "stop", stop
        limit = len(self.text) if reason is not None else max(self._streamed, len(self.text) - self._hold)
        delta = self.text[self._streamed : limit]
        self._streamed = limit
        return StepOutcome(ids, delta, reason, matched)

    def _decode(self, final: bool = False) -> None:
        segment = self.tokenizer.decode(self.token_ids[self._line_start :], skip_special_tokens=True)
        if segment.endswith("\ufffd") and not final:
            # An incomplete multi-byte character: the text before it is released now, the character
            # with the token that completes it (the segment is decoded again then).
            self.text = self.text[: self._line_text_len] + segment.rstrip("\ufffd")
            return
        self.text = self.text[: self._line_text_len] + segment
        if segment.endswith("\n"):
            self._line_start = len(self.token_ids)
            self._line_text_len = len(self.text)

    def _find_stop_string(self) -> tuple[int, str] | None:
        lo = max(0, self._streamed - self._hold)  # earlier text was checked when it was streamed
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            pos = self.text.find(stop, lo)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _tokens_covering(self, start: int, text_end: int) -> int:
        """Fewest tokens whose decoded text reaches ``text_end`` (rare path: only when a stop matched)."""
        for n in range(start + 1, len(self.token_ids) + 1):
            if len(self.tokenizer.decode(self.token_ids[:n], skip_special_tokens=True)) >= text_end:
                return n
        return len(self.token_ids)
