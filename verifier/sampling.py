"""Sampling parameters and the logits processors, applied per tree row with that row's own context.

Order and semantics follow transformers ``generate``: minimum-length suppression and repetition penalty
(processors, which also apply in greedy mode), then temperature, top-k and top-p (warpers, sampling
only). Context-dependent processors see, for each row, the committed tokens plus the row's own
ancestor path, exactly what sequential decoding would have seen at that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the target's next-token distribution is shaped and drawn from.

    ``temperature`` 0 means greedy (argmax). ``top_k`` 0 and ``top_p`` 1.0 disable those filters.
    ``repetition_penalty`` (CTRL; 1.0 = off) divides positive and multiplies negative logits of tokens
    already in the context. ``seed`` seeds the request's own generator (None: fresh entropy).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class RowContext:
    """What context-dependent processors need for one request's step rows.

    ``context_ids`` are the committed tokens (prompt + output, root included); ``num_generated`` counts
    output tokens committed before the step (the root row produces output token ``num_generated + 1``);
    ``suppress_ids`` are banned while fewer than ``min_new_tokens`` output tokens exist (EOS, stop ids).
    """

    context_ids: np.ndarray  # [N] int64
    num_generated: int
    min_new_tokens: int = 0
    suppress_ids: tuple[int, ...] = ()


def apply_processors(logits: torch.Tensor, params: SamplingParams, ctx: RowContext, layout) -> torch.Tensor:
    """Min-length suppression and repetition penalty for rows ``[1+T, V]`` of one request (in place)."""
    depths = layout.depths  # [1+T]
    if ctx.suppress_ids and ctx.num_generated < ctx.min_new_tokens:
        rows = np.nonzero(ctx.num_generated + depths < ctx.min_new_tokens)[0]
        if len(rows):
            ids = torch.as_tensor(ctx.suppress_ids, device=logits.device)
            logits[torch.as_tensor(rows, device=logits.device)[:, None], ids[None, :]] = float("-inf")
    if params.repetition_penalty != 1.0:
        num_rows, vocab = logits.shape
        seen = torch.zeros((num_rows, vocab), dtype=torch.bool, device=logits.device)
        base = torch.as_tensor(ctx.context_ids, device=logits.device, dtype=torch.long)
        seen[:, base] = True
        # Row r also saw the draft tokens of its ancestors-or-self (row 0, the root, is in context_ids).
        r, c = np.nonzero(layout.ancestors[:, 1:])
        if len(r):
            seen[torch.as_tensor(r), torch.as_tensor(layout.token_ids[c])] = True
        penalised = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits = torch.where(seen, penalised, logits)
    return logits


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Rows ``[R, V]`` with the tokens ``bitmask`` ``[R, ceil(V/32)]`` int32 forbids set to -inf (in place):
    bit j of word w allows token 32w+j (xgrammar's layout)."""
    num_rows, vocab = logits.shape
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask[:num_rows].to(logits.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().reshape(num_rows, -1)[:, :vocab]  # [R, V]
    return logits.masked_fill_(~allowed, float("-inf"))


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p (transformers semantics), then softmax: ``[R, V]`` -> probs ``[R, V]``."""
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - params.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.softmax(scores, dim=-1)


def sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One independent draw per row, drawn up front: inverse CDF with one uniform per row.

    Equivalent to Gumbel-max (``argmax(log p + g)``) but needs R uniforms instead of R x V noise.
    ``searchsorted(..., right=True)`` never lands on a zero-probability token.
    """
    cdf = probs.double().cumsum(dim=-1)  # [R, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.clamp_max(probs.shape[-1] - 1).squeeze(1)
