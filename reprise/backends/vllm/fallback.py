"""Where retrieval has little to offer, a chain from the target's own last hidden state: Medusa heads.

The own engine falls back to a trained head when the index has nothing (neural_drafters/hybrid.py);
this is the same fallback for vLLM's worker, which verifies chains. vLLM keeps the hidden state each
request's last token was sampled from (``target_states.TargetStates.rows``); a Medusa head (``reprise
train-drafter --kind mtp --mtp-style medusa``) reads that state alone, and its head ``k`` predicts the
token ``k + 1`` after the one just sampled, so ``K`` heads give a chain of ``K`` draft tokens for
``K`` small matrix products and one product with the target's output embedding per head:

    features = [block_k(h) for each head]             # [K, d]
    p = softmax(features @ W[draft vocabulary].T)     # [K, Vd]
    chain = argmax of each row, with its probability as the node's confidence

Per request and step, the worker sends the head's chain instead of retrieval's when retrieval's chain
expects fewer accepted tokens than the tenant's ``hybrid_threshold`` (``reprise tune --hybrid`` tunes it;
the service's ``DraftingConfig`` otherwise) and the head's chain expects more than it. The step budget
then cuts the chain like any other, so on a host where a drafted step costs more than the head's
tokens are worth it sends nothing; and where the head's own calls cost more than its chains save over
retrieval's, it rests (``FallbackPayoff``). EAGLE and MTP-style heads need the sampled token's embedding and
run one after another; only Medusa heads are read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.draft_tree import DraftTree

SOURCE = "neural"


class NeuralFallback:
    """A Medusa head's chain over one hidden state (float32 on the CPU, whatever the target's device)."""

    def __init__(self, head: Any) -> None:
        self.blocks = [block.float().eval() for block in head.blocks]
        self.d2t = head.d2t.long().cpu()  # draft vocabulary id -> target token id
        self._lm_head: Any = None  # the target's output embedding rows of the draft vocabulary [Vd, d]

    def bind(self, out_embed: Any) -> None:
        """The target's output embedding [vocab, d], once attached to a runner."""
        self._lm_head = out_embed[self.d2t.to(out_embed.device)].float().cpu()

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def draft(self, hidden: Any, max_len: int) -> DraftTree:
        """The chain of at most ``max_len`` tokens the heads predict after the token sampled from
        ``hidden`` [d]; each node's probability is its head's for its token."""
        import torch

        if self._lm_head is None:
            raise RuntimeError("NeuralFallback.draft before bind(): no output embedding")
        k = min(max_len, len(self.blocks))
        if k <= 0:
            return DraftTree.empty(SOURCE)
        with torch.inference_mode():
            h = hidden.float().reshape(1, -1)
            features = torch.cat([block(h) for block in self.blocks[:k]])  # [k, d]
            probs = torch.softmax(features @ self._lm_head.T, dim=-1)
            p, idx = probs.max(dim=-1)
        tokens = self.d2t[idx].numpy().astype(np.int32)
        return DraftTree.chain(tokens, p.numpy().astype(np.float32), source=SOURCE)


@dataclass(slots=True)
class FallbackPayoff:
    """Whether the head pays on the running host, measured as it drafts: the seconds its calls took
    (every step retrieval expected little, whether its chain went out or not) against the seconds its
    chains saved, their accepted tokens beyond what the retrieval chain each replaced expected, each
    worth a request's share of a plain step. Every ``min_calls`` calls the two are compared; where the
    head did not pay, it rests for ``rest_steps`` steps (retrieval's chains alone), then is measured
    again: a host, load or tenant mix on which it pays turns it back on."""

    min_calls: int = 64
    rest_steps: int = 1024
    calls: int = 0
    seconds: float = 0.0  # the head's calls since the last settlement
    saved: float = 0.0  # what its accepted chains saved since then (negative: they did worse than retrieval's)
    resting_until: int = 0  # the proposer's step count from which the head drafts again
    rests: int = 0

    def active(self, step: int) -> bool:
        return step >= self.resting_until

    def spent(self, seconds: float) -> None:
        self.calls += 1
        self.seconds += seconds

    def credit(self, tokens: float, token_seconds: float) -> None:
        """A head chain verified: ``tokens`` accepted beyond retrieval's expectation, each worth
        ``token_seconds`` (a plain step's share of one request)."""
        self.saved += tokens * token_seconds

    def settle(self, step: int) -> bool:
        """Compare once ``min_calls`` calls are in; True when the head starts a rest."""
        if self.calls < self.min_calls:
            return False
        pays = self.saved >= self.seconds
        self.calls, self.seconds, self.saved = 0, 0.0, 0.0
        if pays:
            return False
        self.resting_until = step + self.rest_steps
        self.rests += 1
        return True


def load_fallback(path: str | Path) -> NeuralFallback:
    """The heads of a ``reprise train-drafter --kind mtp --mtp-style medusa`` checkpoint (a checkpoint
    folder or its parent ``OUT``). ValueError for a checkpoint of another kind, FileNotFoundError for
    none."""
    from neural_drafters.checkpoint import load_head
    from neural_drafters.heads import MedusaHead

    head, _ = load_head(path)
    if not isinstance(head, MedusaHead):
        raise ValueError(f"{path}: a {type(head).__name__} checkpoint; the vLLM engine's neural fallback needs a "  # noqa: TRY004 - the file is wrong, not the caller's type
                         "Medusa head (reprise train-drafter --kind mtp --mtp-style medusa)")
    return NeuralFallback(head)
