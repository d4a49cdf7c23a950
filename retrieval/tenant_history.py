"""One tenant's drafting state: its history and corpus indexes, its calibration and its fallback table.

History holds the tenant's past responses, each preceded by the last ``lead_in`` tokens of its prompt
(so the start of a response can be matched: in a chat template the prompt ends with the assistant
header). Whole prompts are not kept here: measured on agent traces, adding them to the shared history
made drafts worse (other sessions' user and tool text dilutes what the assistant says), while the
request's own prompt is drafted from through its own index (``proposer.RepriseSession``).

Each index comes in two forms, real token ids and canonical ids (numbers replaced by class ids, see
``retrieval.vocabulary``), when the proposer has a vocabulary.
"""

from __future__ import annotations

import itertools
import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from retrieval.config import DraftingConfig
from retrieval.policy import AcceptanceMonitor, MonitorConfig
from suffix_index import SuffixIndex, as_tokens
from suffix_index.drafting import (
    KIND_CORPUS,
    KIND_CORPUS_CANONICAL,
    KIND_HISTORY,
    KIND_HISTORY_CANONICAL,
    KIND_PROMPTS,
    KIND_PROMPTS_CANONICAL,
    Calibration,
    FallbackTable,
    native_index,
)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A finished turn as the history receives it: its prompt's tail and its output."""

    session_id: str
    prompt_ids: np.ndarray  # [num_prompt_tokens] int32 (only the last lead_in are kept)
    output_ids: np.ndarray  # [num_output_tokens] int32


@dataclass(frozen=True, slots=True)
class HistoryStats:
    """Figures of one tenant's indexes."""

    num_trajectories: int
    num_history_tokens: int
    num_corpus_documents: int
    num_corpus_tokens: int
    memory_bytes: int
    calibration_observations: int
    fallback_observations: int = 0


@dataclass(slots=True)
class _Live:
    """A running request's sequence: its history id once indexed, its tokens until then."""

    waiting: list[np.ndarray]
    seq_id: int | None = None


class TenantHistory:
    """The indexes a tenant's requests draft from, besides their own.

    Thread-safe: recording takes each index's lock exclusively, drafting sessions read them shared.
    """

    def __init__(self, config: DraftingConfig, classes: np.ndarray) -> None:
        self._config = config
        self._classes = classes
        self._canonical = config.canonical and len(classes) > 0
        budget = config.history_max_bytes
        depth = config.max_depth
        self.history = SuffixIndex(max_depth=depth, max_bytes=budget)
        self.history_canon = SuffixIndex(max_depth=depth, max_bytes=budget) if self._canonical else None
        self.corpus = SuffixIndex(max_depth=depth)
        self.corpus_canon = SuffixIndex(max_depth=depth) if self._canonical else None
        use_prompts = config.use_prompts
        self.prompts = SuffixIndex(max_depth=depth, max_bytes=budget) if use_prompts else None
        self.prompts_canon = SuffixIndex(max_depth=depth, max_bytes=budget) if use_prompts and self._canonical else None
        self._prompt_seen: dict[str, tuple[int, int]] = {}  # session -> (sequence id, prompt tokens indexed)
        self._live: dict[int, _Live] = {}  # running requests' sequences by handle (``open_live``)
        self._live_handles = itertools.count()
        self.calibration = Calibration(config.prior_strength)
        self.fallback = FallbackTable() if config.fallback else None
        self.monitor = AcceptanceMonitor(MonitorConfig(threshold=config.collapse_threshold))
        self._lock = threading.Lock()
        self._next_seq = 0
        self._num_documents = 0

    # ---- writing ----


    @property
    def config(self) -> DraftingConfig:
        """The settings this history was built with."""
        return self._config
    def record(self, prompt_ids: Sequence[int] | np.ndarray, output_ids: Sequence[int] | np.ndarray,
               session_id: str = "") -> int:
        """Add one finished turn (its prompt's tail and its output); returns its sequence id."""
        prompt = as_tokens(prompt_ids, "prompt_ids")
        output = as_tokens(output_ids, "output_ids")
        if self.prompts is not None:
            self._record_prompt(session_id, prompt)
        lead = prompt[len(prompt) - self._config.lead_in :] if self._config.lead_in else prompt[:0]
        seq = np.concatenate([lead, output]) if len(lead) else output
        with self._lock:
            seq_id = self._next_seq
            self._next_seq += 1
        if len(seq) == 0:
            return seq_id
        self._index_history(seq_id, seq)
        return seq_id

    def open_live(self, prompt_ids: Sequence[int] | np.ndarray) -> int | None:
        """A handle on a history sequence for a running request (``DraftingConfig.live_history``): its
        lead-in and output, so the tenant's other running requests draft from it. None where the history
        is not drafted from. While the request is the tenant's only one running, its tokens wait in
        memory (nothing else would draft from them, and its own drafts already see its context; a
        tenant whose requests never overlap drafts exactly as without live history); they join the index
        as soon as another request of the tenant runs. ``close_live`` ends it."""
        if not (self._config.live_history and self._config.use_history):
            return None
        prompt = as_tokens(prompt_ids, "prompt_ids")
        lead = prompt[len(prompt) - self._config.lead_in :] if self._config.lead_in else prompt[:0]
        with self._lock:
            handle = next(self._live_handles)
            self._live[handle] = _Live(waiting=[lead.copy()])
            self._share_live()
        return handle

    def extend_live(self, handle: int, tokens: np.ndarray) -> None:
        """Tokens a running request committed (``open_live``)."""
        with self._lock:
            live = self._live.get(handle)
            if live is None:  # ended
                return
            if live.seq_id is not None:
                self._index_history(live.seq_id, tokens)
                return
            live.waiting.append(np.asarray(tokens, dtype=np.int32).copy())
            self._share_live()

    def close_live(self, handle: int) -> None:
        """The request ended: its live sequence goes (the turn is recorded whole, if at all, by ``record``;
        one the byte budget already evicted is gone)."""
        with self._lock:
            live = self._live.pop(handle, None)
            if live is None or live.seq_id is None:
                return  # never in the index
            for index in (self.history, self.history_canon):
                if index is not None and live.seq_id in index:
                    index.remove(live.seq_id)

    def _share_live(self) -> None:
        """With two or more requests running, every waiting one that has output joins the index (lock held)."""
        if len(self._live) < 2:
            return
        for live in self._live.values():
            if live.seq_id is None and len(live.waiting) > 1:  # its lead-in and some output
                live.seq_id = self._next_seq
                self._next_seq += 1
                tokens, live.waiting = np.concatenate(live.waiting), []
                self._index_history(live.seq_id, tokens)

    def _index_history(self, seq_id: int, tokens: np.ndarray) -> None:
        """Append ``tokens`` to history sequence ``seq_id`` (created when new), and its canonical twin."""
        self.history.extend(seq_id, tokens)
        if self.history_canon is not None:
            self.history_canon.extend(seq_id, self.canonical(tokens))

    def _indexed_live(self) -> list[int]:
        """Running requests' sequences in the history index (lock held)."""
        return [live.seq_id for live in self._live.values() if live.seq_id is not None and live.seq_id in self.history]

    def _record_prompt(self, session_id: str, prompt: np.ndarray) -> None:
        """Index the part of a session's prompt not indexed yet (agents' prompts grow by appending; a
        rewritten conversation only costs a few repeated tokens of drafting data)."""
        with self._lock:
            seq_id, done = self._prompt_seen.get(session_id, (-1, 0))
            if seq_id < 0 or done > len(prompt):
                seq_id, done = self._next_seq, 0
                self._next_seq += 1
            self._prompt_seen[session_id] = (seq_id, len(prompt))
        new = prompt[done:]
        if len(new) and self.prompts is not None:
            self.prompts.extend(seq_id, new)
            if self.prompts_canon is not None:
                self.prompts_canon.extend(seq_id, self.canonical(new))

    def load(self, trajectories: Iterable[Trajectory]) -> int:
        """Record trajectories in commit order (rebuilding from the store); returns how many."""
        count = 0
        for t in trajectories:
            self.record(t.prompt_ids, t.output_ids, t.session_id)
            count += 1
        return count

    def add_documents(self, documents: Iterable[Sequence[int] | np.ndarray], replace: bool = False) -> int:
        """Add corpus documents (REST-style datastore: documentation, code, tool schemas)."""
        with self._lock:
            if replace:
                self.corpus = SuffixIndex(max_depth=self._config.max_depth)
                self.corpus_canon = SuffixIndex(max_depth=self._config.max_depth) if self._canonical else None
                self._num_documents = 0
            count = 0
            for doc in documents:
                tokens = as_tokens(doc, "document")
                if len(tokens) == 0:
                    continue
                doc_id = self._num_documents
                self.corpus.add(doc_id, tokens)
                if self.corpus_canon is not None:
                    self.corpus_canon.add(doc_id, self.canonical(tokens))
                self._num_documents += 1
                count += 1
            return count

    # ---- reading ----

    def canonical(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` with number tokens replaced by their class ids."""
        classes = self._classes
        if len(classes) == 0:
            return tokens
        inside = tokens < len(classes)
        out = tokens.copy()
        out[inside] = classes[tokens[inside]]
        return out

    def sources(self) -> list[tuple[object, int, bool]]:
        """(native index, calibration kind, canonical) for every shared index the configuration uses
        (empty ones too: they fill up while sessions that hold them live on)."""
        pairs: list[tuple[SuffixIndex | None, int, bool]] = []
        with self._lock:
            if self._config.use_history:
                pairs += [(self.history, KIND_HISTORY, False), (self.history_canon, KIND_HISTORY_CANONICAL, True)]
            if self._config.use_corpus:
                pairs += [(self.corpus, KIND_CORPUS, False), (self.corpus_canon, KIND_CORPUS_CANONICAL, True)]
            if self.prompts is not None:
                pairs += [(self.prompts, KIND_PROMPTS, False), (self.prompts_canon, KIND_PROMPTS_CANONICAL, True)]
        return [(native_index(ix), kind, canon) for ix, kind, canon in pairs if ix is not None]

    # ---- snapshots ----

    _MAGIC = b"RPTH"
    _VERSION = 3
    _READS: ClassVar[dict[int, int]] = {2: 7, 3: 8}  # version -> its parts (3 added the fallback table)

    def snapshot(self) -> bytes:
        """Everything this tenant's drafting has learned, as bytes (``restore`` reads them back exactly).

        Layout: magic, version, next sequence id, document count, then length-prefixed parts (history,
        its canonical twin, corpus, its canonical twin, past prompts, their canonical twin — empty when
        absent — the calibration table and the fallback table, empty when off), then a CRC-32 of all that
        precedes it. The privacy layer seals these bytes before storing them. Version 2 snapshots (no
        fallback table) are read too.
        """
        with self._lock:
            live = self._indexed_live()
            parts = [self._without(ix, live) if ix is not None else b"" for ix in
                     (self.history, self.history_canon, self.corpus, self.corpus_canon, self.prompts,
                      self.prompts_canon)]
            parts.append(self.calibration.table().astype("<f4").tobytes())
            parts.append(self.fallback.table().astype("<i8").tobytes() if self.fallback is not None else b"")
            head = self._MAGIC + struct.pack("<IQQ", self._VERSION, self._next_seq, self._num_documents)
        body = head + b"".join(struct.pack("<Q", len(p)) + p for p in parts)
        return body + struct.pack("<I", zlib.crc32(body))

    @staticmethod
    def _without(index: SuffixIndex, live: list[int]) -> bytes:
        """``index`` serialised without running requests' live sequences (a snapshot holds recorded
        turns only: the running ones are recorded whole when they end)."""
        live = [seq for seq in live if seq in index]
        if not live:
            return index.serialize()
        copy = SuffixIndex.deserialize(index.serialize())
        for seq in live:
            copy.remove(seq)
        return copy.serialize()

    def restore(self, data: bytes) -> None:
        """Replace this state with a ``snapshot``; ValueError (nothing changed) if the bytes are not one."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"snapshot must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < 28 or data[:4] != self._MAGIC:
            raise ValueError("not a tenant history snapshot (bad magic or too short)")
        (crc,) = struct.unpack("<I", data[-4:])
        if zlib.crc32(data[:-4]) != crc:
            raise ValueError("tenant history snapshot is corrupt (checksum mismatch)")
        version, next_seq, num_docs = struct.unpack("<IQQ", data[4:24])
        if version not in self._READS:
            raise ValueError(f"tenant history snapshot version {version} is not supported (expected {self._VERSION})")
        parts, pos, end = [], 24, len(data) - 4
        for _ in range(self._READS[version]):
            if pos + 8 > end:
                raise ValueError("tenant history snapshot is truncated")
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            pos += 8
            if pos + n > end:
                raise ValueError("tenant history snapshot is truncated")
            parts.append(data[pos:pos + n])
            pos += n
        if pos != end:
            raise ValueError("tenant history snapshot has trailing bytes")
        indexes = [SuffixIndex.deserialize(p) if p else None for p in parts[:6]]
        history, corpus = indexes[0], indexes[2]
        if history is None or corpus is None:
            raise ValueError("tenant history snapshot lacks its history or corpus index")
        if (indexes[1] is None) != (indexes[3] is None):
            raise ValueError("tenant history snapshot has only one of its canonical indexes")
        table = np.frombuffer(parts[6], dtype="<f4").astype(np.float32)
        calibration = Calibration(self._config.prior_strength)
        calibration.set_table(table)
        fallback = FallbackTable() if self._config.fallback else None
        if fallback is not None and len(parts) > 7 and parts[7]:
            fallback.set_table(np.frombuffer(parts[7], dtype="<i8").astype(np.int64))
        with self._lock:
            self.history, self.history_canon, self.corpus, self.corpus_canon = history, indexes[1], corpus, indexes[3]
            if self._config.use_prompts:  # else this configuration does not draft from past prompts
                self.prompts = indexes[4] or SuffixIndex(max_depth=self._config.max_depth)
                self.prompts_canon = indexes[5] if self._canonical else None
            self._prompt_seen = {}
            self._canonical = indexes[1] is not None
            self.calibration = calibration
            self.fallback = fallback
            self.monitor = AcceptanceMonitor(MonitorConfig(threshold=self._config.collapse_threshold))
            self._next_seq = next_seq
            self._num_documents = num_docs
            self._live.clear()  # running requests' sequences were in the replaced index: they stop sharing

    def stats(self) -> HistoryStats:
        indexes = [ix for ix in (self.history, self.history_canon, self.corpus, self.corpus_canon, self.prompts,
                                 self.prompts_canon) if ix is not None]
        with self._lock:
            running = len(self._indexed_live())
        return HistoryStats(
            num_trajectories=self.history.num_sequences - running,  # recorded turns, not running outputs
            num_history_tokens=self.history.num_tokens,
            num_corpus_documents=self.corpus.num_sequences,
            num_corpus_tokens=self.corpus.num_tokens,
            memory_bytes=sum(ix.memory_bytes() for ix in indexes),
            calibration_observations=self.calibration.num_observations,
            fallback_observations=self.fallback.num_observations if self.fallback is not None else 0,
        )
