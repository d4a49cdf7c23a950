"""Helpers for the replay tests: writing small traces, a one-token-per-character tokenizer, scripted
proposers whose drafts are derived from the recorded response (so the expected figures are known)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.draft_tree import DraftTree


def write_trace(path: Path, lines: Sequence[Any], *, compress: bool | None = None) -> Path:
    """Write JSON lines (dicts are dumped, strings written as they are); gzip when asked or when the
    name ends in .gz."""
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    data = text.encode("utf-8")
    if compress if compress is not None else path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def conversation(tenant: str, session: str, *turns: tuple[str, str], calls: list[int] | None = None) -> dict:
    obj: dict[str, Any] = {"tenant": tenant, "session": session,
                           "messages": [{"role": r, "content": c} for r, c in turns]}
    if calls is not None:
        obj["calls"] = calls
    return obj


class CharTokenizer:
    """One token per character (its code point), with the canonical prompt layout: easy to reason about."""

    name = "chars"
    vocab_size = 0x10000  # the Basic Multilingual Plane: enough for the tests' text

    @staticmethod
    def decode_token(token: int) -> str:
        return chr(token)

    @staticmethod
    def encode(text: str) -> np.ndarray:
        return np.fromiter((ord(c) for c in text), dtype=np.int32, count=len(text))

    def message_ids(self, role: str, content: str) -> np.ndarray:
        return self.encode(f"<|{role}|>\n{content}\n")

    def prompt_ids(self, messages) -> np.ndarray:
        parts = [self.message_ids(m.role, m.content) for m in messages]
        return np.concatenate([*parts, self.encode("<|assistant|>\n")])

    def response_ids(self, text: str) -> np.ndarray:
        return self.encode(text)


class ScriptedSession:
    """Drafts from the recorded response: ``script(pos, truth)`` returns the DraftTree for that step."""

    def __init__(self, owner: ScriptedProposer, prompt: np.ndarray) -> None:
        self.owner = owner
        self.prompt = prompt
        self.committed: list[int] = []
        self.truth = owner.responses[len(owner.sessions)]
        owner.sessions.append(self)
        self.finished = None

    def propose(self, budget: int) -> DraftTree:
        self.owner.budgets.append(budget)
        return self.owner.script(len(self.committed), self.truth)

    def commit(self, verified) -> None:
        self.committed.extend(int(t) for t in verified.token_ids)

    def finish(self, record: bool = True) -> None:
        self.finished = record


class ScriptedProposer:
    """Knows the responses in call order (a test double only: real drafters never see the future)."""

    def __init__(self, responses: Sequence[str], script: Callable[[int, np.ndarray], DraftTree]) -> None:
        self.responses = [CharTokenizer.encode(r) for r in responses]
        self.script = script
        self.sessions: list[ScriptedSession] = []
        self.budgets: list[int] = []

    def begin(self, tenant, session_id, prompt_ids, request_id=""):
        return ScriptedSession(self, np.asarray(prompt_ids))
