"""The chain's first token from the target itself: retrieval's roots re-ranked by the target's logits.

A chain verifier accepts nothing from a step whose first token is wrong, however good the rest of the
tree was (``reprise replay --chain --headroom``: the right root of the same tree would win a large part
of the tree's lead). The drafter ranks the roots by history counts alone; the target has just computed
the distribution that chose the step's last token, and that distribution also carries information about
the token after it (LogitSpec, arXiv 2507.01449: the next-next token is often among the last logit's
top candidates). So, per request and step, with ``h`` the hidden state the last committed token was
sampled from and ``W`` the target's output embedding:

    paths, values = root_paths(tree, k)            # the best path under each root, expected accepted
    belief = softmax(W[roots] @ h)                 # the target's logits restricted to the candidate roots
    send paths[argmax(log values + weight * log belief)] among the drafter's ``top`` best roots

``weight`` 0 is the drafter's own choice; large weights follow the target's ranking of the roots.
Computing the logits of a handful of rows costs a few dot products per request.

The next-token logits only hint at the token after next. A Medusa head trained on the target's own
states predicts it (``reprise train-drafter --kind mtp --mtp-style medusa``: head 1 on ``h_t`` is trained
against the target's greedy token ``t + 2``); with one (``load_rerank_head``), ``h`` becomes that head's
feature ``h + SiLU(W1 h + b1)`` before the product with ``W`` (one ``d x d`` matrix-vector product per
request and step). An untrained Medusa block is the identity, so the head starts as the logits re-rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class FirstTokenRerank:
    """How the roots are re-ranked: among the drafter's ``top`` best roots, by ``log value + weight *
    log p_target(root | roots)``."""

    top: int = 4
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError(f"top must be >= 1, got {self.top}")
        if not np.isfinite(self.weight) or self.weight < 0.0:
            raise ValueError(f"weight must be finite and >= 0, got {self.weight}")

    def choose(self, values: np.ndarray, root_logits: np.ndarray) -> int:
        """The index (into the drafter's root order, best first) of the path to send. ``values``: each
        root path's expected accepted tokens [num_roots]; ``root_logits``: the target's logit of each
        root's token [num_roots] (same order)."""
        k = min(self.top, len(values))
        if k <= 1 or self.weight == 0.0:
            return 0
        logits = np.asarray(root_logits[:k], dtype=np.float64)
        log_belief = logits - logits.max()
        log_belief -= np.log(np.exp(log_belief).sum())
        score = np.log(np.maximum(np.asarray(values[:k], dtype=np.float64), 1e-9)) + self.weight * log_belief
        return int(np.argmax(score))


def load_rerank_head(path: str | Path) -> Any:
    """The first Medusa block of a ``reprise train-drafter --kind mtp --mtp-style medusa`` checkpoint (a
    checkpoint folder or its parent ``OUT``): a float32 module from the hidden state a token was sampled
    from to features whose logits rank the token after it. ValueError for a checkpoint of another kind."""
    from neural_drafters.checkpoint import load_head
    from neural_drafters.heads import MedusaHead

    head, _ = load_head(path)
    if not isinstance(head, MedusaHead):
        raise ValueError(f"{path}: a {type(head).__name__} checkpoint; re-ranking the first token needs a Medusa "  # noqa: TRY004 - the file is wrong, not the caller's type
                         "head (reprise train-drafter --kind mtp --mtp-style medusa)")
    return head.blocks[0].float().eval()
