"""Drafting with a trained head during decoding: per-request state fed by the target's hidden states.

    drafter = HeadDrafter(head, parts, DraftSettings(top_k=8, depth=6))
    request = drafter.start(prompt_ids)
    request.observe_hidden(prompt_states)      # [P-1, d]: the target's top states at prompt[:-1]
    draft = request.propose(budget)            # NeuralDraft over target token ids
    request.observe_hidden(step_states)        # the verifier's states of the rows that committed tokens
    request.commit(token_ids)

Alignment: hidden state ``h_j`` is the target's state at position j, the one that predicted token j+1.
After a verification step the rows kept are the root and the accepted nodes, i.e. the states before each
committed token, so ``observe_hidden`` before ``commit`` keeps ``num_hidden == len(tokens) - 1``. The last
committed token's own state is not known until the next pass: every head drafts from ``h_{N-2}`` and the
last token (EAGLE's ``(f_t, x_{t+1})`` input; Medusa's head k predicts ``t+1+k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from neural_drafters.heads import EagleHead, MedusaHead, MTPHead, TargetParts
from neural_drafters.layers import KVCache
from neural_drafters.tree import EMPTY, CandidateTree, sampled_tree, topk_tree

MODES = ("topk", "sample")
_CHUNK = 512  # context rows per head pass (bounds the attention matrix on long prompts)


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """How trees are grown. ``topk``: EAGLE-2 dynamic trees (``top_k`` per node, ``depth`` levels).
    ``sample``: ``width`` chains drawn at ``temperature`` (for sampling requests; the nodes' q rows go to
    the verifier). ``vocab`` keeps the output layer to the head's most frequent tokens: on CPU a 2,048-row
    layer stays in cache and is ~10x faster than 8,192 rows."""

    top_k: int = 8
    depth: int = 6
    mode: str = "topk"
    width: int = 4
    temperature: float = 1.0
    seed: int | None = None
    vocab: int = 0  # draft only the head's first (most frequent) ``vocab`` tokens; 0 = all

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown draft mode {self.mode!r}; use one of {MODES}")
        for name in ("top_k", "depth", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 0:
            raise ValueError(f"vocab must be >= 0 (0 = the whole draft vocabulary), got {self.vocab}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True, slots=True)
class NeuralDraft:
    """A head's draft over target token ids: ``probs[i]`` = q(token i | its parent); ``q`` [T, V] the
    full-vocabulary rows sampled nodes were drawn from (None for deterministic top-k trees)."""

    token_ids: np.ndarray  # [T] int32
    parents: np.ndarray  # [T] int32
    probs: np.ndarray  # [T] float32
    q: torch.Tensor | None = None  # [T, V]
    q_mode: str = "without_replacement"

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def score(self) -> float:
        """Expected accepted tokens: the sum of path probabilities."""
        path = self.probs.astype(np.float64).copy()
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                path[i] *= path[p]
        return float(path.sum())


class HeadDrafter:
    """A head with its target's borrowed weights and the tree settings; ``start`` one per request."""

    def __init__(self, head: Any, parts: TargetParts, settings: DraftSettings | None = None) -> None:
        self.head = head.eval()
        self.settings = settings or DraftSettings()
        self.config = head.config
        self.d2t = head.d2t.long()
        if parts.lm_head.shape[0] != len(self.d2t):
            raise ValueError(f"lm_head rows {parts.lm_head.shape[0]} != draft vocabulary {len(self.d2t)}")
        keep = self.settings.vocab
        if 0 < keep < len(self.d2t):
            self.d2t = self.d2t[:keep]
            parts = TargetParts(parts.embed, parts.lm_head[:keep].contiguous(), parts.final_norm)
        self.parts = parts
        self.generator = torch.Generator()
        if self.settings.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.settings.seed)

    def start(self, prompt_ids: Sequence[int]) -> RequestDrafter:
        return RequestDrafter(self, prompt_ids)


class RequestDrafter:
    """One request's drafting state (not thread-safe; the engine thread owns it)."""

    def __init__(self, owner: HeadDrafter, prompt_ids: Sequence[int]) -> None:
        self.owner = owner
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        d = owner.config.hidden_size
        self._hidden = torch.zeros(max(2 * len(self.tokens), 256), d)
        self.num_hidden = 0
        head, c = owner.head, owner.config
        num_modules = c.num_heads if isinstance(head, MTPHead) else 1
        self._caches = [KVCache(c.num_key_value_heads, c.head_dim, torch.float32) for _ in range(num_modules)]
        self._done = [0] * num_modules  # context positions processed per module
        self._outputs = [torch.zeros(self._hidden.shape[0], d) for _ in range(num_modules)]
        self._ctx_len = 0

    # ---- inputs ------------------------------------------------------------------------------------
    def observe_hidden(self, states: Any) -> None:
        """Append the target's top states for the next positions (``[n, d]``, any float dtype)."""
        rows = torch.as_tensor(np.asarray(states) if not torch.is_tensor(states) else states).float()
        if rows.ndim != 2 or rows.shape[1] != self._hidden.shape[1]:
            raise ValueError(f"hidden states must be [n, {self._hidden.shape[1]}], got {tuple(rows.shape)}")
        end = self.num_hidden + rows.shape[0]
        if end > self._hidden.shape[0]:
            size = max(2 * self._hidden.shape[0], end)
            self._hidden = _grow(self._hidden, size)
            self._outputs = [_grow(o, size) for o in self._outputs]
        self._hidden[self.num_hidden : end] = rows
        self.num_hidden = end

    def commit(self, token_ids: Sequence[int] | np.ndarray) -> None:
        self.tokens.extend(int(t) for t in token_ids)

    @property
    def ready(self) -> bool:
        """Whether every committed token but the last has its hidden state (drafting is possible)."""
        return len(self.tokens) >= 2 and self.num_hidden >= len(self.tokens) - 1

    # ---- drafting ----------------------------------------------------------------------------------
    def propose(self, budget: int) -> NeuralDraft:
        """A tree of at most ``budget`` nodes; empty when hidden states are missing."""
        if budget <= 0 or not self.ready:
            return _EMPTY_DRAFT
        s = self.owner.settings
        with torch.inference_mode():
            root, expand, max_depth = self._prepare()
            depth = min(s.depth, max_depth)
            if s.mode == "topk":
                tree = topk_tree(root, expand, top_k=s.top_k, depth=depth, budget=budget)
            else:
                tree = sampled_tree(root, expand, width=s.width, depth=depth, budget=budget,
                                    temperature=s.temperature, generator=self.owner.generator)
            for cache in self._caches:  # drop the tree's rows, keep the context's
                cache.length = min(cache.length, self._ctx_len)
        return self._to_draft(tree)

    def _prepare(self):
        """Bring the context up to date; the root distribution, the expand function and the max depth."""
        head, parts = self.owner.head, self.owner.parts
        last = len(self.tokens) - 2  # position of the newest usable state h_{N-2}
        if isinstance(head, MedusaHead):
            logp = torch.log_softmax(parts.logits(head(self._hidden[last])), -1)  # [K, Vd]
            return logp[0], (lambda nodes, parents, tokens, depth: logp[depth].expand(len(nodes), -1)), len(logp)
        self._advance()
        self._ctx_len = self._caches[0].length
        root_feature = self._outputs[0][last]
        root = torch.log_softmax(parts.logits(self._decode(root_feature, 1)), -1)
        features: dict[int, torch.Tensor] = {}
        rows: dict[int, int] = {}  # candidate id -> its row in the (EAGLE) cache after the context
        parent_of: dict[int, int] = {}

        def expand(nodes: list[int], parents: list[int], tokens: list[int], depth: int) -> torch.Tensor:
            inputs = torch.stack([root_feature if p < 0 else features[p] for p in parents])  # [F, d]
            embeds = parts.embed[self.owner.d2t[torch.tensor(tokens)]]  # [F, d]
            for n, p in zip(nodes, parents):
                parent_of[n] = p
            if isinstance(head, EagleHead):
                out = self._eagle_tree_pass(nodes, embeds, inputs, last + depth, rows, parent_of)
                module_depth = 1
            else:  # MTP: module depth+1 at the last position, over its own context rows
                module_depth = depth + 1
                cache = self._caches[depth]
                past = cache.view()
                mask = torch.zeros(1, 1, len(nodes), past[0].shape[2] + len(nodes))
                mask[0, 0, :, past[0].shape[2] :] = _blocked_except_diagonal(len(nodes))
                positions = torch.full((1, len(nodes)), last)
                out, _ = head.module(module_depth)(embeds[None], inputs[None], positions, past, mask)
                out = out[0]
            for n, f in zip(nodes, out):
                features[n] = f
            return torch.log_softmax(parts.logits(self._decode(out, module_depth)), -1)

        max_depth = 1 + (self.owner.config.num_heads - 1 if isinstance(head, MTPHead) else 64)
        return root, expand, max_depth

    def _decode(self, features: torch.Tensor, module_depth: int) -> torch.Tensor:
        head = self.owner.head
        return head.output_features(features, module_depth) if isinstance(head, MTPHead) else features

    def _eagle_tree_pass(self, nodes, embeds, inputs, position, rows, parent_of) -> torch.Tensor:
        """Run the EAGLE layer on frontier nodes attending to the context, their ancestors and themselves."""
        cache = self._caches[0]
        ctx = self._ctx_len
        past = cache.view()
        width = past[0].shape[2] + len(nodes)
        mask = torch.full((1, 1, len(nodes), width), torch.finfo(torch.float32).min)
        mask[0, 0, :, :ctx] = 0.0
        for i, n in enumerate(nodes):
            a = parent_of[n]
            while a >= 0:
                mask[0, 0, i, rows[a]] = 0.0
                a = parent_of[a]
            mask[0, 0, i, past[0].shape[2] + i] = 0.0
        positions = torch.full((1, len(nodes)), position)
        out, (k, v) = self.owner.head(embeds[None], inputs[None], positions, past, mask)
        for i, n in enumerate(nodes):
            rows[n] = cache.length + i
        cache.append(k, v)
        return out[0]

    def _advance(self) -> None:
        """Run every module over the context positions whose inputs are now known."""
        head, parts = self.owner.head, self.owner.parts
        tokens = torch.tensor(self.tokens)
        for m, cache in enumerate(self._caches):  # module m+1 reads token j+m+1 at position j
            source = self._hidden if m == 0 else self._outputs[m - 1]
            available = self.num_hidden if m == 0 else self._done[m - 1]
            end = min(available, len(self.tokens) - 1 - m)
            module = head.module(m + 1)
            while self._done[m] < end:
                start = self._done[m]
                stop = min(end, start + _CHUNK)
                n = stop - start
                embeds = parts.embed[tokens[start + m + 1 : stop + m + 1]]
                mask = torch.zeros(1, 1, n, start + n)
                mask[0, 0, :, start:] = _causal(n)
                positions = torch.arange(start, stop)[None]
                out, (k, v) = module(embeds[None], source[start:stop][None], positions, cache.view(), mask)
                cache.append(k, v)
                self._outputs[m][start:stop] = out[0]
                self._done[m] = stop

    def _to_draft(self, tree: CandidateTree) -> NeuralDraft:
        if not len(tree):
            return _EMPTY_DRAFT
        d2t = self.owner.d2t
        ids = d2t[torch.from_numpy(tree.tokens)].numpy().astype(np.int32)
        q = None
        if tree.q is not None:
            q = torch.zeros(len(tree), self.owner.config.vocab_size)
            q[:, d2t] = tree.q
        return NeuralDraft(ids, tree.parents, np.exp(tree.logq).astype(np.float32), q)


_EMPTY_DRAFT = NeuralDraft(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))
_ = EMPTY  # re-exported for callers that build trees directly


def _grow(t: torch.Tensor, size: int) -> torch.Tensor:
    out = t.new_zeros(size, t.shape[1])
    out[: t.shape[0]] = t
    return out


def _causal(n: int) -> torch.Tensor:
    """Additive causal mask [n, n]."""
    return torch.full((n, n), torch.finfo(torch.float32).min).triu(1)


def _blocked_except_diagonal(n: int) -> torch.Tensor:
    m = torch.full((n, n), torch.finfo(torch.float32).min)
    return m.fill_diagonal_(0.0)
