"""Training a draft head on the target's own hidden states (CPU-sized: minutes for SmolLM2-135M).

1. ``extract_features``: the target runs once over each tokenized conversation; kept per position are its
   top hidden state (fp16) and its greedy next token (what the head must agree with).
2. ``choose_draft_vocab``: the most frequent greedy tokens of the training positions (EAGLE-3's reduced
   draft vocabulary): the head's output layer shrinks from V to ``draft_vocab_size`` rows.
3. ``Trainer``: AdamW with warmup and cosine decay, gradient clipping; the loss counts only positions
   whose predicted state lies in an assistant span (``Example.loss_mask``):
   * eagle: SmoothL1 between predicted and true next features + ``ce_weight`` x cross-entropy of the
     decoded features against the target's greedy token (EAGLE-1, with hard targets); inputs get
     uniform noise (EAGLE-1's robustness to its own drift);
   * medusa: head k's cross-entropy against the target's greedy token k steps later, weighted 0.8^(k-1);
   * mtp: module k's cross-entropy, teacher-forced on the true tokens (DeepSeek-V3).
4. ``Trainer.evaluate``: held-out top-1 agreement with the target's greedy token (per head / module).

Batches are drawn from a generator seeded by (seed, step), so a resumed run draws what the uninterrupted
run would have drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from neural_drafters.heads import EagleHead, MedusaHead, MTPHead, TargetParts


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenized conversation: ``loss_mask[i]`` is True where token i belongs to an assistant turn."""

    token_ids: np.ndarray  # [L] int32
    loss_mask: np.ndarray  # [L] bool

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.loss_mask):
            raise ValueError(f"token_ids ({len(self.token_ids)}) and loss_mask ({len(self.loss_mask)}) differ")


@dataclass
class FeatureSet:
    """Per example: tokens, mask, the target's top hidden states [L, d] (fp16), its greedy tokens [L]."""

    tokens: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    greedy: list[np.ndarray] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(t) for t in self.tokens))

    @property
    def num_masked(self) -> int:
        return int(sum(int(m.sum()) for m in self.masks))

    def __len__(self) -> int:
        return len(self.tokens)

    def to_state(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "masks": self.masks, "hidden": self.hidden, "greedy": self.greedy}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> FeatureSet:
        return cls(state["tokens"], state["masks"], state["hidden"], state["greedy"])


def extract_features(model: Any, examples: Sequence[Example], *, window: int = 1024,
                     on_progress: Callable[[int], None] | None = None) -> FeatureSet:
    """Run the target over each example (in windows of ``window`` tokens, each a fresh context)."""
    out = FeatureSet()
    base = model.base_model
    lm_head = model.get_output_embeddings()
    device = next(model.parameters()).device
    with torch.inference_mode():
        for ex in examples:
            for start in range(0, len(ex.token_ids), window):
                ids = ex.token_ids[start : start + window]
                mask = ex.loss_mask[start : start + window]
                if len(ids) < 3 or not mask[1:].any():
                    continue
                hidden = base(input_ids=torch.as_tensor(ids, dtype=torch.long, device=device)[None]).last_hidden_state[0]
                greedy = lm_head(hidden).argmax(-1)
                out.tokens.append(np.asarray(ids, np.int32))
                out.masks.append(np.asarray(mask, bool))
                out.hidden.append(hidden.to("cpu", torch.float16))
                out.greedy.append(greedy.cpu().numpy().astype(np.int32))
                if on_progress is not None:
                    on_progress(len(ids))
    return out


def choose_draft_vocab(features: FeatureSet, size: int, vocab_size: int) -> torch.Tensor:
    """``size`` token ids: the target's greedy tokens by frequency on assistant positions, then on all
    positions, then the remaining ids in order (so the set is always full). Most frequent first, so a
    drafter may keep only a prefix (``DraftSettings.vocab``: a smaller output layer stays in cache)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = np.zeros(vocab_size, np.float64)
    for greedy, mask in zip(features.greedy, features.masks):
        np.add.at(counts, greedy, 1e-3)
        np.add.at(counts, greedy[mask], 1.0)
    order = np.lexsort((np.arange(vocab_size), -counts))[:size]
    return torch.as_tensor(order, dtype=torch.long)


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """Optimiser and batch settings (defaults sized for a few minutes on one CPU core)."""

    steps: int = 300
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    clip: float = 0.5
    feature_noise: float = 0.1
    ce_weight: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 4:
            raise ValueError(f"seq_len must be >= 4, got {self.seq_len}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


class Trainer:
    """Trains ``head`` (its ``d2t`` already set) against ``parts``; ``state_dict`` makes it resumable."""

    def __init__(self, head: Any, parts: TargetParts, train: FeatureSet, settings: TrainSettings) -> None:
        if not len(train):
            raise ValueError("no training examples (no assistant tokens in the data?)")
        self.head, self.parts, self.train_set, self.settings = head, parts, train, settings
        self.step = 0
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=settings.weight_decay)
        vocab = parts.embed.shape[0]
        t2d = torch.full((vocab,), -100, dtype=torch.long)  # -100: outside the draft vocabulary (ignored)
        t2d[head.d2t] = torch.arange(len(head.d2t))
        self.t2d = t2d
        scale = torch.cat([h[:256].float() for h in train.hidden[:64]]).std().item()
        self.noise = settings.feature_noise * scale
        lengths = np.array([len(t) for t in train.tokens], np.float64)
        self._weights = lengths / lengths.sum()

    def lr_at(self, step: int) -> float:
        s = self.settings
        if step < s.warmup:
            return s.lr * (step + 1) / s.warmup
        progress = (step - s.warmup) / max(1, s.steps - s.warmup)
        return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def train_step(self) -> dict[str, float]:
        """One optimiser step on a batch drawn for ``self.step``; returns its loss figures."""
        self.head.train()
        batch = self._batch(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + self.step)  # resumable noise
        loss, stats = head_loss(self.head, self.parts, self.t2d, batch, self.settings, self.noise,
                                generator=generator)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.settings.clip)
        self.optimizer.step()
        self.step += 1
        self.head.eval()
        return stats

    def _batch(self, step: int) -> dict[str, torch.Tensor]:
        s = self.settings
        rng = np.random.default_rng([s.seed, step])
        d = self.train_set.hidden[0].shape[1]
        tokens = torch.zeros(s.batch_size, s.seq_len, dtype=torch.long)
        masks = torch.zeros(s.batch_size, s.seq_len, dtype=torch.bool)
        hidden = torch.zeros(s.batch_size, s.seq_len, d)
        greedy = torch.zeros(s.batch_size, s.seq_len, dtype=torch.long)
        for b in range(s.batch_size):
            i = int(rng.choice(len(self._weights), p=self._weights))
            n = len(self.train_set.tokens[i])
            start = int(rng.integers(0, max(1, n - s.seq_len + 1)))
            end = min(n, start + s.seq_len)
            length = end - start
            tokens[b, :length] = torch.from_numpy(self.train_set.tokens[i][start:end].astype(np.int64))
            masks[b, :length] = torch.from_numpy(self.train_set.masks[i][start:end])
            hidden[b, :length] = self.train_set.hidden[i][start:end].float()
            greedy[b, :length] = torch.from_numpy(self.train_set.greedy[i][start:end].astype(np.int64))
        return {"tokens": tokens, "masks": masks, "hidden": hidden, "greedy": greedy}

    def evaluate(self, features: FeatureSet) -> dict[str, Any]:
        """Held-out top-1 agreement with the target's greedy token, per head / module (in order)."""
        hits: np.ndarray | None = None
        total: np.ndarray | None = None
        with torch.inference_mode():
            for i in range(len(features)):
                batch = {
                    "tokens": torch.from_numpy(features.tokens[i].astype(np.int64))[None],
                    "masks": torch.from_numpy(features.masks[i])[None],
                    "hidden": features.hidden[i].float()[None],
                    "greedy": torch.from_numpy(features.greedy[i].astype(np.int64))[None],
                }
                _, stats = head_loss(self.head, self.parts, self.t2d, batch, self.settings, 0.0, evaluate=True)
                h, t = np.asarray(stats["hits"]), np.asarray(stats["count"])
                hits = h if hits is None else hits + h
                total = t if total is None else total + t
        if hits is None or total is None:
            return {"agreement": [], "positions": 0}
        agree = [float(h / t) if t else 0.0 for h, t in zip(hits, total)]
        return {"agreement": agree, "positions": int(total[0])}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "settings": self.settings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])


def head_loss(head: Any, parts: TargetParts, t2d: torch.Tensor, batch: dict[str, torch.Tensor],
              settings: TrainSettings, noise: float, evaluate: bool = False,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The kind's loss on a batch of windows; stats hold per-head ``hits``/``count`` (agreement)."""
    tokens, masks, hidden, greedy = batch["tokens"], batch["masks"], batch["hidden"], batch["greedy"]
    length = tokens.shape[1]
    embed = parts.embed
    if noise > 0 and not evaluate:
        hidden_in = hidden + (torch.rand(hidden.shape, generator=generator) * 2 - 1) * noise
    else:
        hidden_in = hidden
    positions = torch.arange(length - 1)[None].expand(tokens.shape[0], -1)
    losses, hits, counts = [], [], []

    def ce_part(features: torch.Tensor, target_greedy: torch.Tensor, mask: torch.Tensor, weight: float) -> None:
        logits = parts.logits(features)  # [B, n, Vd]
        labels = t2d[target_greedy].masked_fill(~mask, -100)
        losses.append(weight * F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
        pred = head.d2t[logits.argmax(-1)]
        hits.append(int(((pred == target_greedy) & mask).sum()))
        counts.append(int(mask.sum()))

    if isinstance(head, EagleHead):
        # pair j = (h_j, x_{j+1}) predicts h_{j+1}, which the target decodes to greedy[j+1]
        feats, _ = head(embed[tokens[:, 1:]], hidden_in[:, :-1], positions)
        mask = masks[:, 1:]
        diff = F.smooth_l1_loss(feats, hidden[:, 1:], reduction="none").mean(-1)  # [B, L-1]
        losses.append((diff * mask).sum() / mask.sum().clamp_min(1))
        ce_part(feats, greedy[:, 1:], mask, settings.ce_weight)
    elif isinstance(head, MedusaHead):
        feats = head(hidden_in)  # [K, B, L, d]
        for k in range(1, feats.shape[0] + 1):  # head k on h_j predicts greedy[j + k]
            if k >= length:
                break
            ce_part(feats[k - 1][:, : length - k], greedy[:, k:], masks[:, k:], 0.8 ** (k - 1))
    elif isinstance(head, MTPHead):
        source = hidden_in
        for k in range(1, len(head.modules_) + 1):  # module k at j reads x_{j+k}, predicts greedy[j + k]
            n = length - k
            if n < 1:
                break
            out, _ = head.module(k)(embed[tokens[:, k:]], source[:, :n], positions[:, :n])
            ce_part(head.output_features(out, k), greedy[:, k:], masks[:, k:], 1.0)
            source = out
    else:
        raise TypeError(f"unknown head type {type(head).__name__}")
    loss = torch.stack(losses).sum()
    return loss, {"loss": float(loss.detach()), "hits": hits, "count": counts}
