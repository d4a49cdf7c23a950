"""From an engine's committed tokens to a front's stream events, the same for every front and engine.

An engine commits tokens a verification step at a time: one token, or many when a draft was accepted.
A stream whose events followed steps would show how much each draft was accepted (and so what the
tenant's history predicted). ``ReplyStream`` regroups them: each ``TextDelta`` carries exactly
``stream_chunk_tokens`` tokens (the last may be shorter) and exactly their text, so event sizes follow tokens,
never steps.

A token's text comes from incremental detokenization (``TokenTexts``: each token's piece is the text
the decoded output grew by when it was added, with the usual window of a few tokens so multi-byte
characters and merges decode right). The engine's own text stays the source of truth (it is cut at a
stop string's match): a token's event carries the part of the engine's text that the pieces up to that
token cover, less the few characters a stop string could begin with (the engine holds back as many at
the end of each step), so which event carries which text depends on the tokens only, never on where
steps ended. What the engine releases only at the end (a character cut off by the length limit, the
held-back tail) leaves with the last event.

When the reply ends it is parsed for tool calls (``Request.tool_format``); the calls leave as
``ToolCallDelta`` events before ``Finished``, whose ``content`` is the reply's text without them. A
front that shows content and calls apart (OpenAI chat) asks for ``hold_tool_text``: text that may begin
a tool call is then held back (``serving.tool_calls.StreamingToolText``) and released at the end only if
it did not parse as calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from serving.records import Finished, Request, TextDelta, ToolCall, ToolCallDelta
from serving.tool_calls import FORMATS, StreamingToolText

# Tokens of context re-decoded with each new token: enough for a multi-byte character split over
# tokens and for tokenizers whose pieces merge with their neighbours when decoded.
_WINDOW = 6


class TokenTexts:
    """Incremental detokenization of an output: the characters each new token adds."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been handed out

    def add(self, token_id: int) -> int:
        """How many characters the decoded output grew by with ``token_id`` (0 while a character is
        incomplete; those characters come with a later token)."""
        self.ids.append(int(token_id))
        if self.tokenizer is None:
            return 0
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) < len(before):
            return 0
        grown = len(after) - len(before)
        self._prefix = max(self._prefix, len(self.ids) - _WINDOW)
        self._read = len(self.ids)
        return grown


class ReplyStream:
    """One request's committed tokens into ``TextDelta`` events, and its end into the closing events."""

    def __init__(self, request: Request, tokenizer: Any, hold_tool_text: bool = False) -> None:
        self.request = request
        self.size = max(1, request.stream_chunk_tokens or 1)
        self._texts = TokenTexts(tokenizer)
        self._held = StreamingToolText() if hold_tool_text and request.tool_format is not None else None
        # The engine holds back this many characters at the end of each step (a stop string may begin
        # there); each token's event holds back as many, so event texts do not depend on step boundaries.
        self._stop_hold = max((len(s) for s in request.params.stop), default=1) - 1
        self._engine_text = ""  # the engine's text, as released
        self._covered = 0  # characters the tokens so far decode to
        self._sent = 0  # characters handed to events (or to the tool-call holdback)
        self._pending_ids: list[int] = []
        self._pending_text: list[str] = []
        self.text = ""  # the whole reply text, built once, here

    def add(self, token_ids: Sequence[int], text: str) -> list[TextDelta]:
        """A step's committed tokens and the text the engine released with them."""
        self._engine_text += text
        out: list[TextDelta] = []
        for t in token_ids:
            self._covered += self._texts.add(t)
            self._pending_ids.append(int(t))
            self._pending_text.append(self._take(min(self._covered - self._stop_hold, len(self._engine_text))))
            if len(self._pending_ids) == self.size:
                out.append(self._chunk())
        return out

    def finish(self, finished: Finished) -> list[TextDelta | ToolCallDelta | Finished]:
        """The last chunk (all text the engine released not yet sent), then the parsed tool calls, then
        ``Finished`` with the reply's content and the finish reason after parsing."""
        self._pending_text.append(self._take(len(self._engine_text)))
        out: list[TextDelta | ToolCallDelta | Finished] = []
        if self._pending_ids or any(self._pending_text):
            out.append(self._chunk())
        held = self._held.finish() if self._held is not None else ""
        content, reason = self.text, finished.finish_reason
        calls: tuple[ToolCall, ...] = ()
        if self.request.tool_format is not None and reason in ("stop", "eos"):
            parsed = FORMATS[self.request.tool_format].parse(self.text)
            if parsed is not None:
                content, calls, reason = parsed.content, parsed.tool_calls, "tool_calls"
        if not calls and held:
            out.append(TextDelta((), held))
        out.extend(ToolCallDelta(i, c) for i, c in enumerate(calls))
        out.append(dataclasses.replace(finished, finish_reason=reason, text=self.text, content=content,
                                       tool_calls=calls))
        return out

    def _take(self, upto: int) -> str:
        """The engine's released text up to character ``upto`` not yet taken."""
        if upto <= self._sent:
            return ""
        piece = self._engine_text[self._sent:upto]
        self._sent = upto
        self.text += piece
        return piece

    def _chunk(self) -> TextDelta:
        text = "".join(self._pending_text)
        if self._held is not None:
            text = self._held.feed(text)
        delta = TextDelta(tuple(self._pending_ids), text)
        self._pending_ids, self._pending_text = [], []
        return delta
