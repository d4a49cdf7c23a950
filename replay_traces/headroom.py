"""What a better first token would win a chain verifier (``reprise replay --chain --headroom``).

A chain verifier accepts a prefix of the one path it is sent, so a step whose first token is wrong
accepts nothing, however good the rest of the tree was. At each step of a chain replay this module asks,
of the tree the chain was taken from (``retrieval.chain.ChainSession.tree``), what the step would have
accepted had the chain been:

  chain          the path sent (``best_path``): the replay's own figure
  best_of_2      the better, for this step's truth, of the best paths under the tree's 2 best roots
  best_of_4      the same over its 4 best roots
  any_root       the best path under whichever root is right (a perfect first-token choice)
  tree           the whole tree verified as a tree (what a tree verifier gets from the same nodes)

Each figure is tau over the same steps (tokens a step yields, the accepted ones and the bonus token
while the response lasts, per step), counterfactual per step along the chain's own trajectory (the
session commits what the chain accepted), so ``chain`` equals the replay's tau. ``best_of_k`` is an
oracle: it bounds what any re-ranking of the first ``k`` roots could win, so a chain target above
``best_of_2`` needs a first-token predictor that beats the drafter's estimates by more than re-ranking
its top two candidates would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay_traces.replay import StepTally, accepted_path, decode_response
from retrieval.chain import ChainProposer, best_path_per_root

FIGURES = ("chain", "best_of_2", "best_of_4", "any_root", "tree")
_TOP = {"best_of_2": 2, "best_of_4": 4}


@dataclass
class ChainHeadroom:
    """Per-step observer of a chain replay (``replay_calls(on_step=headroom.observe)``)."""

    budget: int
    steps: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIGURES, 0))  # yielded, per figure

    def observe(self, session: Any, target: list[int], pos: int) -> None:
        """One step: ``session.tree`` is the tree the chain was taken from, ``target[pos:]`` the truth."""
        self.steps += 1
        left = len(target) - pos
        tree = session.tree
        got = dict.fromkeys(FIGURES, 0)  # accepted draft tokens, per figure
        if len(tree):
            ids = tree.token_ids.tolist()
            per_root = [len(accepted_path([ids[i] for i in path.tolist()], list(range(-1, len(path) - 1)), target, pos))
                        for path in best_path_per_root(tree, self.budget)]
            got["chain"] = per_root[0]  # the first is the path best_path sent
            for name, k in _TOP.items():
                got[name] = max(per_root[:k])
            got["any_root"] = max(per_root)
            got["tree"] = len(accepted_path(ids, tree.parents.tolist(), target, pos))
        for name, accepted in got.items():
            self.tokens[name] += min(accepted + 1, left)  # the bonus token while the response lasts

    def taus(self) -> dict[str, float]:
        """Each figure as tau over the observed steps (0.0 before any step)."""
        if not self.steps:
            return dict.fromkeys(FIGURES, 0.0)
        return {name: self.tokens[name] / self.steps for name in FIGURES}


def turns_headroom(chains: ChainProposer, tenant: str, turns: Iterable[tuple[Sequence[int], Sequence[int]]],
                   budget: int) -> ChainHeadroom:
    """Decode one tenant's turns (prompt ids, output ids), in order, as a chain replay through
    ``chains`` (chains of at most ``budget`` tokens; each turn joins the tenant's history when it ends)
    and return what the steps showed.

    For outputs that were not recorded in a trace: ``reprise bench engine`` asks it what its history
    could have predicted of the target model's own outputs."""
    headroom = ChainHeadroom(budget)
    tally = StepTally()
    for prompt, output in turns:
        session = chains.begin(tenant, "", np.asarray(prompt, dtype=np.int32))
        decode_response(session, np.asarray(output, dtype=np.int32), budget, tally, "turns_headroom",
                        headroom.observe)
        session.finish(record=True)
    return headroom
