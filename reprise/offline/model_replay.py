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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fileio import atomic_writer
from replay_traces.replay import accepted_path
from reprise.engine.engine import Engine
from reprise.offline.calls import ModelCall
from retrieval.draft_tree import DraftTree
from retrieval.session import Verified
from verifier.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class Reference:
    """The target's greedy decoding of one call and its hidden states ``[P-1+M, d]`` (positions 0..P+M-2)."""

    call: ModelCall
    output_ids: tuple[int, ...]
    hidden: Any  # torch.Tensor, float32, CPU
    seconds: float  # wall clock of the decoding
    cpu_seconds: float = 0.0  # the decoding thread's CPU time (steadier on a shared machine)


class HiddenStateRecorder:
    """A proposer that drafts nothing and keeps the hidden states the engine hands it."""

    wants_hidden_states = True

    def __init__(self) -> None:
        self.chunks: list[Any] = []

    def begin(self, tenant: str, session_id: str, prompt_ids: Any, request_id: str = "") -> HiddenStateRecorder:
        self.chunks = []
        return self

    def observe_hidden(self, states: Any) -> None:
        self.chunks.append(states.detach().float().cpu().clone())

    def propose(self, budget: int) -> Any:
        return DraftTree.empty()

    def commit(self, verified: Any) -> None:
        if verified.hidden_states is not None:
            self.observe_hidden(verified.hidden_states)

    def finish(self, record: bool = True) -> None:
        pass


def decode_reference(model: Any, tokenizer: Any, calls: Sequence[ModelCall], *, max_new_tokens: int,
                     on_call: Callable[[int, Reference], None] | None = None,
                     cache_dir: str | Path | None = None, model_key: str = "") -> list[Reference]:
    """Greedy decoding of every call by the engine without drafts (the plain-decoding baseline).

    With ``cache_dir``, each reference is stored there (hidden states as fp16) under a digest of
    ``model_key``, the prompt and ``max_new_tokens``, and read back instead of decoded next time."""
    max_len = max(len(c.prompt_ids) for c in calls) + max_new_tokens + 8
    recorder = HiddenStateRecorder()
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
                with atomic_writer(path) as fh:
                    torch.save({"output_ids": torch.tensor(ref.output_ids), "hidden": ref.hidden.half(),
                                "seconds": seconds, "cpu_seconds": cpu}, fh)
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
            path = accepted_path(tree.token_ids.tolist(), tree.parents.tolist(), truth, pos) if n else []
            a = len(path)
            end = min(pos + a + 1, len(truth))
            session.commit(Verified(np.asarray(truth[pos:end], dtype=np.int32), np.asarray(path, dtype=np.int32),
                                    n > 0, ref.hidden[prompt_len - 1 + pos : prompt_len - 1 + end]))
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
    return DraftTree.empty()
