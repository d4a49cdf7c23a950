"""Hidden-state keyed reuse (Oilbird, arXiv 2608.03839): find a continuation by the target's state.

Agent traffic repeats itself except for freshly minted values (ids, dates, paths); those break exact-suffix
keys although the continuation is already in the tenant's history. The target's hidden state right
after such a value still says "what comes next", so positions are also keyed by a low-dimensional
projection of the state (``Projection``: a fixed random or PCA map to ``dim`` dimensions, L2-normalised,
fp16). To draft: take the newest state ``h_{N-2}`` and the last token ``x_{N-1}``; among the tenant's past
positions (and the request's own earlier ones) whose next token is ``x_{N-1}``, find the most similar
state by cosine; at or above ``fire_threshold`` copy the continuation after it (``copy_long`` tokens at
or above ``long_threshold``, else ``copy_short``).

Memory is per tenant (``TenantMemory``: a ring of at most ``max_positions`` rows; the oldest segments are
dropped first) and a request sees only its own tenant's rows. Persisting the vectors (encrypted, next to
the tenant's trajectories) is the application's job: ``RequestReuse.finish`` returns the segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PROJECTIONS = ("random", "pca")


@dataclass(frozen=True, slots=True)
class ReuseSettings:
    """Thresholds are cosine similarities of projected states (the paper's: fire 0.80, long 0.90)."""

    dim: int = 64
    fire_threshold: float = 0.80
    long_threshold: float = 0.90
    copy_long: int = 48
    copy_short: int = 8
    max_positions: int = 200_000
    projection: str = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if not -1.0 <= self.fire_threshold <= self.long_threshold <= 1.0:
            raise ValueError(
                f"need -1 <= fire_threshold <= long_threshold <= 1, got {self.fire_threshold}, {self.long_threshold}"
            )
        if self.copy_short < 1 or self.copy_long < self.copy_short:
            raise ValueError(f"need 1 <= copy_short <= copy_long, got {self.copy_short}, {self.copy_long}")
        if self.max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {self.max_positions}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"unknown projection {self.projection!r}; use one of {PROJECTIONS}")


class Projection:
    """``states [n, d] -> unit vectors [n, dim]`` (fp16): ``normalize((states - mean) @ matrix)``."""

    def __init__(self, matrix: np.ndarray, mean: np.ndarray | None = None) -> None:
        self.matrix = np.asarray(matrix, np.float32)  # [d, dim]
        self.mean = np.zeros(self.matrix.shape[0], np.float32) if mean is None else np.asarray(mean, np.float32)

    @classmethod
    def random(cls, hidden_size: int, dim: int, seed: int = 0) -> Projection:
        """A fixed Gaussian map (Johnson-Lindenstrauss: cosines are preserved approximately)."""
        rng = np.random.default_rng(seed)
        return cls(rng.standard_normal((hidden_size, dim)).astype(np.float32) / np.sqrt(dim))

    @classmethod
    def pca(cls, samples: np.ndarray, dim: int) -> Projection:
        """The top ``dim`` principal directions of ``samples`` [n, d] (centred)."""
        x = np.asarray(samples, np.float64)
        if x.ndim != 2 or x.shape[0] < 2:
            raise ValueError(f"PCA needs at least 2 samples of shape [n, d], got {x.shape}")
        mean = x.mean(0)
        _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
        return cls(vt[:dim].T.astype(np.float32), mean.astype(np.float32))

    @property
    def hidden_size(self) -> int:
        return self.matrix.shape[0]

    @property
    def dim(self) -> int:
        return self.matrix.shape[1]

    def __call__(self, states: np.ndarray) -> np.ndarray:
        x = (np.asarray(states, np.float32) - self.mean) @ self.matrix
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        return x.astype(np.float16)


class TenantMemory:
    """One tenant's keyed positions: a ring of ``capacity`` rows (vector, next token, segment, position)."""

    def __init__(self, dim: int, capacity: int) -> None:
        self.vectors = np.zeros((capacity, dim), np.float16)
        self.next_token = np.full(capacity, -1, np.int32)
        self.segment = np.full(capacity, -1, np.int64)
        self.position = np.zeros(capacity, np.int32)
        self.segments: dict[int, np.ndarray] = {}  # segment id -> its tokens
        self._rows_left: dict[int, int] = {}
        self._cursor = 0
        self._next_segment = 0

    @property
    def capacity(self) -> int:
        return len(self.next_token)

    @property
    def num_rows(self) -> int:
        return int((self.segment >= 0).sum())

    def nbytes(self) -> int:
        rows = self.vectors.nbytes + self.next_token.nbytes + self.segment.nbytes + self.position.nbytes
        return rows + sum(t.nbytes for t in self.segments.values())

    def add(self, tokens: np.ndarray, positions: np.ndarray, vectors: np.ndarray) -> int:
        """Key ``positions`` of the sequence ``tokens`` by ``vectors`` [n, dim]; returns the segment id.

        Position j is stored only when token j+1 exists (its next token is the lookup key). When more
        rows arrive than fit, the newest ``capacity`` are kept.
        """
        tokens = np.asarray(tokens, np.int32)
        positions = np.asarray(positions, np.int64)
        keep = (positions >= 0) & (positions < len(tokens) - 1)
        positions, vectors = positions[keep][-self.capacity :], np.asarray(vectors)[keep][-self.capacity :]
        seg = self._next_segment
        self._next_segment += 1
        if not len(positions):
            return seg
        self.segments[seg] = tokens
        self._rows_left[seg] = len(positions)
        rows = (self._cursor + np.arange(len(positions))) % self.capacity
        for old in np.unique(self.segment[rows]):  # segments losing rows to the ring
            if old >= 0:
                self._rows_left[int(old)] -= int((self.segment[rows] == old).sum())
                if self._rows_left[int(old)] <= 0:
                    del self._rows_left[int(old)], self.segments[int(old)]
        self.vectors[rows] = vectors
        self.next_token[rows] = tokens[positions + 1]
        self.segment[rows] = seg
        self.position[rows] = positions
        self._cursor = int((rows[-1] + 1) % self.capacity)
        return seg

    def best(self, query: np.ndarray, next_token: int) -> tuple[float, np.ndarray]:
        """(similarity, continuation after the match) of the most similar row keyed by ``next_token``."""
        rows = np.flatnonzero(self.next_token == next_token)
        if not len(rows):
            return -1.0, _EMPTY
        sims = self.vectors[rows].astype(np.float32) @ query.astype(np.float32)
        i = int(np.argmax(sims))
        row = rows[i]
        tokens = self.segments[int(self.segment[row])]
        return float(sims[i]), tokens[int(self.position[row]) + 2 :]


_EMPTY = np.zeros(0, np.int32)


class HiddenStateMemory:
    """All tenants' memories (created on first use) and the shared projection."""

    def __init__(self, hidden_size: int | None = None, settings: ReuseSettings | None = None,
                 projection: Projection | None = None) -> None:
        self.settings = settings or ReuseSettings()
        self._projection = projection
        if projection is not None and hidden_size is not None and projection.hidden_size != hidden_size:
            raise ValueError(f"projection expects hidden size {projection.hidden_size}, got {hidden_size}")
        if projection is not None and projection.dim != self.settings.dim:
            raise ValueError(f"projection has {projection.dim} dimensions, settings.dim is {self.settings.dim}")
        if projection is None and self.settings.projection == "pca":
            raise ValueError("a PCA projection must be fitted first: pass Projection.pca(samples, dim)")
        if projection is None and hidden_size is not None:
            self._projection = Projection.random(hidden_size, self.settings.dim, self.settings.seed)
        self._tenants: dict[str, TenantMemory] = {}

    @property
    def projection(self) -> Projection:
        """The projection (a random one is made for the first states seen when none was given)."""
        if self._projection is None:
            raise ValueError("the memory has no projection yet: give hidden_size or a projection")
        return self._projection

    def ensure_projection(self, hidden_size: int) -> Projection:
        if self._projection is None:
            self._projection = Projection.random(hidden_size, self.settings.dim, self.settings.seed)
        elif self._projection.hidden_size != hidden_size:
            raise ValueError(f"hidden states have size {hidden_size}, the projection expects "
                             f"{self._projection.hidden_size}")
        return self._projection

    def tenant(self, name: str) -> TenantMemory:
        memory = self._tenants.get(name)
        if memory is None:
            memory = self._tenants[name] = TenantMemory(self.settings.dim, self.settings.max_positions)
        return memory

    def forget(self, name: str) -> None:
        """Drop a tenant's memory (tenant deleted or shredded)."""
        self._tenants.pop(name, None)

    def add_segment(self, tenant: str, tokens: np.ndarray, positions: np.ndarray, vectors: np.ndarray) -> int:
        """Restore a persisted segment (vectors already projected)."""
        vectors = np.asarray(vectors)
        dim = self.settings.dim
        if vectors.ndim != 2 or vectors.shape[1] != dim or len(vectors) != len(positions):
            raise ValueError(f"vectors must be [{len(positions)}, {dim}], got {vectors.shape}")
        return self.tenant(tenant).add(tokens, positions, vectors)

    def start(self, tenant: str, prompt_ids: Sequence[int]) -> RequestReuse:
        return RequestReuse(self, tenant, prompt_ids)


@dataclass(frozen=True, slots=True)
class ReuseDraft:
    """A copied continuation (a chain) and the similarity that found it."""

    token_ids: np.ndarray  # [n] int32
    similarity: float

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Segment:
    """What a finished request leaves for persistence: its tokens and the projected vectors of positions."""

    tokens: np.ndarray  # [n] int32
    positions: np.ndarray  # [m] int32
    vectors: np.ndarray  # [m, dim] float16


class RequestReuse:
    """One request: its own keyed positions plus read access to its tenant's memory."""

    def __init__(self, owner: HiddenStateMemory, tenant: str, prompt_ids: Sequence[int]) -> None:
        self.owner = owner
        self.tenant = tenant
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self._vectors = np.zeros((max(256, 2 * len(self.tokens)), owner.settings.dim), np.float16)
        self.num_hidden = 0

    def observe_hidden(self, states: np.ndarray) -> None:
        states = np.asarray(states, np.float32)
        if states.ndim != 2:
            raise ValueError(f"hidden states must be [n, hidden_size], got shape {states.shape}")
        vectors = self.owner.ensure_projection(states.shape[1])(states)
        end = self.num_hidden + len(vectors)
        if end > len(self._vectors):
            grown = np.zeros((max(2 * len(self._vectors), end), self._vectors.shape[1]), np.float16)
            grown[: self.num_hidden] = self._vectors[: self.num_hidden]
            self._vectors = grown
        self._vectors[self.num_hidden : end] = vectors
        self.num_hidden = end

    def commit(self, token_ids: Sequence[int] | np.ndarray) -> None:
        self.tokens.extend(int(t) for t in token_ids)

    def propose(self, budget: int) -> ReuseDraft:
        """The continuation after the most similar keyed position, or an empty draft."""
        n = len(self.tokens)
        if budget <= 0 or n < 2 or self.num_hidden < n - 1:
            return ReuseDraft(_EMPTY, -1.0)
        s = self.owner.settings
        query = self._vectors[n - 2]
        last = self.tokens[-1]
        sim, cont = self.owner.tenant(self.tenant).best(query, last)
        own = np.asarray(self.tokens, np.int32)
        rows = np.flatnonzero(own[1 : n - 1] == last)  # own positions j < N-2 whose next token is `last`
        if len(rows):
            sims = self._vectors[rows].astype(np.float32) @ query.astype(np.float32)
            i = int(np.argmax(sims))
            if sims[i] > sim:
                sim, cont = float(sims[i]), own[rows[i] + 2 :]
        if sim < s.fire_threshold or not len(cont):
            return ReuseDraft(_EMPTY, sim)
        length = min(budget, s.copy_long if sim >= s.long_threshold else s.copy_short)
        return ReuseDraft(np.array(cont[:length], np.int32), sim)

    def finish(self, record: bool = True) -> Segment | None:
        """With ``record``, key this request's positions in its tenant's memory; returns the segment."""
        if not record:
            return None
        tokens = np.asarray(self.tokens, np.int32)
        m = min(self.num_hidden, len(tokens) - 1)
        if m <= 0:
            return None
        positions = np.arange(m, dtype=np.int32)
        vectors = self._vectors[:m].copy()
        self.owner.tenant(self.tenant).add(tokens, positions, vectors)
        return Segment(tokens, positions, vectors)
