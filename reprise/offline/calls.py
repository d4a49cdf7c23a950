"""The trace calls the target model decodes in the model benchmarks and the hybrid's tuning, and their
prompts in the model's own chat template.

``reprise bench verify``, ``reprise bench neural`` and ``reprise tune --hybrid`` decode a few calls of
each trace, chosen so that history helps the later ones: where a trace runs its tasks several times
(tau_airline's trials, react_hotpotqa's episodes of one question), call ``call_index`` of ``trials``
trials of each task, in file order. A prompt is the model's chat template over the call's messages, cut
to its last ``prompt_tokens`` tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay_traces.traces import Call, iter_calls


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One trace call prepared for the target: its tenant, session and prompt token ids."""

    tenant: str
    session: str
    index: int
    prompt_ids: tuple[int, ...]


def task_key(session: str, first_message: str) -> str:
    """Trials of one task share a key: ``task3-trial1`` -> ``task3``; traces whose sessions do not name
    the task (react_hotpotqa numbers episodes globally) group by the first message instead (the question)."""
    stripped = re.sub(r"-trial\d+$", "", session)
    return stripped if not re.fullmatch(r"ep\d+", stripped) else "q:" + first_message[-300:]


def pick_calls(path: str | Path, *, calls: int, trials: int, call_index: int,
               per_session: bool = True) -> list[Call]:
    """``calls`` calls of a trace, in file order: call ``call_index`` of ``trials`` trials of each task
    that has that many. With ``per_session``, a trace whose tasks do not repeat (or ``trials`` 1) gives
    up to ``trials`` consecutive calls of each session from ``call_index`` on instead (an agent's later
    steps resemble its earlier ones)."""
    by_task: dict[str, dict[str, list[Call]]] = {}  # task -> session -> its calls, in file order
    for call in iter_calls(path, skip_bad_lines=True):
        first = call.messages[0].content if call.messages else ""
        by_task.setdefault(task_key(call.session, first), {}).setdefault(call.session, []).append(call)
    chosen: list[Call] = []
    if not per_session or (trials > 1 and any(len(s) >= trials for s in by_task.values())):
        for sessions in by_task.values():
            picks = [c[call_index] for c in sessions.values() if len(c) > call_index]
            if len(picks) >= trials:
                chosen += picks[:trials]
            if len(chosen) >= calls:
                break
    else:
        for sessions in by_task.values():
            for c in sessions.values():
                chosen += c[min(call_index, len(c) - 1) :][:trials]
            if len(chosen) >= calls:
                break
    return sorted(chosen[:calls], key=lambda c: c.index)


def chat_prompt_ids(tokenizer: Any, call: Call, prompt_tokens: int) -> list[int]:
    """The call's prompt in ``tokenizer``'s chat template (generation prompt added), its last
    ``prompt_tokens`` token ids."""
    messages = [{"role": m.role, "content": m.content} for m in call.messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
    return ids[-prompt_tokens:]


def select_calls(path: str | Path, tokenizer: Any, *, calls: int, trials: int, call_index: int,
                 prompt_tokens: int) -> list[ModelCall]:
    """``pick_calls`` (per session where tasks do not repeat), each with its prompt token ids."""
    return [ModelCall(c.tenant, c.session, c.index, tuple(chat_prompt_ids(tokenizer, c, prompt_tokens)))
            for c in pick_calls(path, calls=calls, trials=trials, call_index=call_index)]
