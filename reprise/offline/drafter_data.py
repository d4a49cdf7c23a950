"""Training conversations for draft heads: trace conversations in the target's own chat template, with
a mask of the assistant spans (the only tokens the head's loss counts).

Every line of a trace file (docs/replay.md, "Traces") is one conversation; its messages are rendered
with the tokenizer's chat template, tokenized once with character offsets, and a token is marked when
it starts inside an assistant message's content or its end-of-turn marker. Files contribute in turn
(round robin), so a token budget spreads over all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neural_drafters.training import Example
from replay_traces.replay import session_share
from replay_traces.traces import iter_calls


@dataclass(frozen=True, slots=True)
class Conversation:
    """One trace line: who it belongs to and its messages as (role, content) pairs."""

    path: str
    session: str
    messages: tuple[tuple[str, str], ...]


def read_conversations(path: str | Path, *, exclude_sessions: frozenset[str] = frozenset()) -> Iterator[Conversation]:
    """The conversations of a trace file in file order (the last call of each line carries all of it)."""
    last: Any = None
    for call in iter_calls(path, skip_bad_lines=True):
        if last is not None and call.line_no != last.line_no:
            yield _conversation(last)
        last = call
    if last is not None:
        yield _conversation(last)


def _conversation(call: Any) -> Conversation:
    messages = tuple((m.role, m.content) for m in call.messages) + (("assistant", call.response),)
    return Conversation(call.path, call.session, messages)


def assistant_spans(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (content and end marker).

    Raises ValueError when the template does not render conversations as growing prefixes."""
    dicts = [{"role": r, "content": c} for r, c in messages]
    text = tokenizer.apply_chat_template(dicts, tokenize=False)
    spans = []
    for i, (role, _) in enumerate(messages):
        if role != "assistant":
            continue
        before = tokenizer.apply_chat_template(dicts[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(dicts[: i + 1], tokenize=False)
        if not text.startswith(upto) or not upto.startswith(before):
            raise ValueError("the chat template does not render conversations as growing prefixes")
        spans.append((len(before), len(upto.rstrip("\n"))))
    return text, spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> Example:
    """Token ids and the assistant-span mask of one conversation in the target's chat template."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], np.int64)
    mask = np.zeros(len(ids), bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return Example(ids, mask)


def crop(example: Example, length: int, lead: int = 128) -> Example:
    """At most ``length`` tokens starting ``lead`` tokens before the first assistant token (long system
    prompts and tool dumps before the first answer teach the head nothing)."""
    first = int(np.argmax(example.loss_mask)) if example.loss_mask.any() else 0
    start = max(0, first - lead)
    return Example(example.token_ids[start : start + length], example.loss_mask[start : start + length])


def training_examples(tokenizer: Any, paths: Sequence[str | Path], *, max_tokens: int,
                      exclude_sessions: Iterable[str] = (), skip_conversations: int = 0,
                      max_conversation_tokens: int = 2048) -> list[tuple[str, Example]]:
    """(session, example) pairs from the files in turn until ``max_tokens`` tokens are collected; each
    conversation contributes at most ``max_conversation_tokens`` (see ``crop``)."""
    excluded = frozenset(exclude_sessions)
    streams = [itertools.islice(read_conversations(p), skip_conversations, None) for p in paths]
    out: list[tuple[str, Example]] = []
    total = 0
    live = list(streams)
    while live and total < max_tokens:
        for stream in list(live):
            conv = next(stream, None)
            if conv is None:
                live.remove(stream)
                continue
            if conv.session in excluded or not any(r == "assistant" for r, _ in conv.messages):
                continue
            example = crop(tokenize_conversation(tokenizer, conv.messages), max_conversation_tokens)
            if not example.loss_mask.any():
                continue
            out.append((conv.session, example))
            total += len(example.token_ids)
            if total >= max_tokens:
                break
    return out


def split_by_session(items: Sequence[tuple[str, Example]], held_out: float, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(train, held-out): whole sessions go to one side, picked by a seeded hash of the session id."""
    train: list[Example] = []
    test: list[Example] = []
    for session, example in items:
        (test if session_share(session, seed) < held_out else train).append(example)
    if not test and len(train) > 1:  # tiny data: keep at least one example aside
        test.append(train.pop())
    return train, test
