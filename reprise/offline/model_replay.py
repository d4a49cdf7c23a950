"""Replay through the target model: its own greedy outputs are the truth, its hidden states feed drafters.

The canonical replay (replay_traces/) checks drafts against recorded responses in a fixed tokenization,
so it cannot run a drafter that needs the target's hidden states. Here trace prompts go through the
target itself (its chat template, cut to the last ``prompt_tokens`` tokens):

1. ``decode_reference``: the engine decodes each prompt greedily without drafts and records, per call,
   the output and the target's top hidden state at every position (prompt prefill, then each step's
   root row): the same states a drafting engine would hand its sessions.
2. ``simulate``: a proposer drafts against those references, step by step, exactly as the greedy engine
   would accept (longest matching root path plus one bonus token), receiving the hidden states of the
   committed positions; each finished call joins the tenant's history. Greedy acceptance depends only
   on the draft and the true continuation, so this is the engine's tau without its cost-model cuts, at
   the cost of drafting alone: threshold sweeps take seconds.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay_traces.replay import accepted_length


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One trace call prepared for the target: its tenant, session and prompt token ids."""

    tenant: str
    session: str
    index: int
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reference:
    """The target's greedy decoding of one call and its hidden states ``[P-1+M, d]`` (positions 0..P+M-2)."""

    call: ModelCall
    output_ids: tuple[int, ...]
    hidden: Any  # torch.Tensor, float32, CPU
    seconds: float  # wall clock of the decoding
    cpu_seconds: float = 0.0  # the decoding thread's CPU time (steadier on a shared machine)


def task_key(session: str, first_message: str) -> str:
    """Trials of one task share a key (``task3-trial1`` -> ``task3``; ReAct episodes by their question)."""
    from reprise.benchmarks.verify import task_key as key

    return key(session, first_message)


def select_calls(path: str | Path, tokenizer: Any, *, calls: int, trials: int, call_index: int,
                 prompt_tokens: int) -> list[ModelCall]:
    """``calls`` calls of a trace, in file order. With ``trials`` > 1 and tasks run several times: call
    ``call_index`` of ``trials`` trials of each task (history from earlier trials helps later ones).
    Otherwise: up to ``trials`` consecutive calls of each session from ``call_index`` on (an agent's
    later steps resemble its earlier ones)."""
    from replay_traces.traces import iter_calls

    by_task: dict[str, dict[str, list[Any]]] = {}
    for call in iter_calls(path, skip_bad_lines=True):
        first = call.messages[0].content if call.messages else ""
        by_task.setdefault(task_key(call.session, first), {}).setdefault(call.session, []).append(call)
    chosen: list[Any] = []
    if trials > 1 and any(len(s) >= trials for s in by_task.values()):
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
    out = []
    for call in sorted(chosen[:calls], key=lambda c: c.index):
        messages = [{"role": m.role, "content": m.content} for m in call.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append(ModelCall(call.tenant, call.session, call.index, tuple(ids[-prompt_tokens:])))
    return out


class _Recorder:
    """A proposer that drafts nothing and keeps the hidden states the engine hands it."""

    wants_hidden_states = True

    def __init__(self) -> None:
        self.chunks: list[Any] = []

    def begin(self, tenant: str, session_id: str, prompt_ids: Any, request_id: str = "") -> _Recorder:
        self.chunks = []
        return self

    def observe_hidden(self, states: Any) -> None:
        self.chunks.append(states.detach().float().cpu().clone())

    def propose(self, budget: int) -> Any:
        from retrieval.draft_tree import DraftTree

        return DraftTree.empty()

    def commit(self, token_ids: Any) -> None:
        pass

    def finish(self, record: bool = True) -> None:
        pass


def decode_reference(model: Any, tokenizer: Any, calls: Sequence[ModelCall], *, max_new_tokens: int,
                     on_call: Callable[[int, Reference], None] | None = None,
                     cache_dir: str | Path | None = None, model_key: str = "") -> list[Reference]:
    """Greedy decoding of every call by the engine without drafts (the plain-decoding baseline).

    With ``cache_dir``, each reference is stored there (hidden states as fp16) under a digest of
    ``model_key``, the prompt and ``max_new_tokens``, and read back instead of decoded next time."""
    import torch

    from reprise.engine.engine import Engine
    from verifier.runner import ModelRunner

    max_len = max(len(c.prompt_ids) for c in calls) + max_new_tokens + 8
    recorder = _Recorder()
    engine = Engine(ModelRunner(model, max_len=max_len, max_draft_nodes=0), recorder, tokenizer)
    refs = []
    for i, call in enumerate(calls):
        path = _cache_path(cache_dir, model_key, call, max_new_tokens) if cache_dir is not None else None
        if path is not None and path.is_file():
            saved = torch.load(path, weights_only=True)
            ref = Reference(call, tuple(saved["output_ids"].tolist()), saved["hidden"].float(),
                            float(saved["seconds"]), float(saved.get("cpu_seconds", 0.0)))
        else:
            start, start_cpu = time.perf_counter(), time.thread_time()
            result = engine.generate(list(call.prompt_ids), tenant=call.tenant, max_new_tokens=max_new_tokens)
            seconds, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            ref = Reference(call, tuple(result.token_ids), torch.cat(recorder.chunks), seconds, cpu)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")
                torch.save({"output_ids": torch.tensor(ref.output_ids), "hidden": ref.hidden.half(),
                            "seconds": seconds, "cpu_seconds": cpu}, tmp)
                os.replace(tmp, path)
        refs.append(ref)
        if on_call is not None:
            on_call(i, ref)
    return refs


def _cache_path(cache_dir: str | Path, model_key: str, call: ModelCall, max_new_tokens: int) -> Path:
    digest = hashlib.sha256(f"{model_key}\0{max_new_tokens}\0".encode())
    digest.update(np.asarray(call.prompt_ids, dtype="<i4").tobytes())
    return Path(cache_dir) / f"{digest.hexdigest()[:32]}.pt"


@dataclass
class SimulationReport:
    """Counters of one simulated replay: tau = output tokens / steps; ``propose_seconds`` is CPU time."""

    calls: int = 0
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    propose_seconds: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "tokens": self.tokens, "steps": self.steps, "tau": round(self.tau, 4),
                "drafted_per_step": round(self.drafted / self.steps, 3) if self.steps else 0.0,
                "accept_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "propose_ms_per_step": round(1000 * self.propose_seconds / self.steps, 3) if self.steps else 0.0,
                "steps_by_source": dict(self.sources)}


def simulate(proposer: Any, references: Sequence[Reference], *, budget: int = 32,
             max_new_tokens: int | None = None) -> SimulationReport:
    """Greedy replay of ``references`` through ``proposer`` (one history across them, in order).

    Like the engine, a step drafts at most ``max_new_tokens - produced - 1`` nodes (drafts past the last
    token are waste; ``max_new_tokens`` defaults to each output's length)."""
    report = SimulationReport()
    for ref in references:
        call, truth = ref.call, list(ref.output_ids)
        prompt_len = len(call.prompt_ids)
        session = proposer.begin(call.tenant, call.session, list(call.prompt_ids), str(call.index))
        observe = getattr(session, "observe_hidden", None)
        if observe is not None:
            observe(ref.hidden[: prompt_len - 1])
        pos = 0
        limit = len(truth) if max_new_tokens is None else max_new_tokens
        while pos < len(truth):
            room = min(budget, limit - pos - 1)
            t0 = time.thread_time()
            tree = session.propose(room) if room > 0 else _empty_tree()
            report.propose_seconds += time.thread_time() - t0  # CPU time: steadier on a shared machine
            n = len(tree)
            a = accepted_length(tree.token_ids.tolist(), tree.parents.tolist(), truth, pos) if n else 0
            end = min(pos + a + 1, len(truth))
            if observe is not None:
                observe(ref.hidden[prompt_len - 1 + pos : prompt_len - 1 + end])
            session.commit(truth[pos:end])
            report.steps += 1
            report.drafted += n
            report.accepted += min(a, end - pos)
            source = tree.source if n else "none"
            report.sources[source] = report.sources.get(source, 0) + 1
            pos = end
        session.finish(record=True)
        report.calls += 1
        report.tokens += len(truth)
    return report


def _empty_tree() -> Any:
    from retrieval.draft_tree import DraftTree

    return DraftTree.empty()


def references_to_arrays(references: Sequence[Reference]) -> list[np.ndarray]:
    """The output ids of every reference (for comparing engines' outputs)."""
    return [np.asarray(r.output_ids, np.int32) for r in references]
