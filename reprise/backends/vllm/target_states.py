"""What the proposer reads of the target's own computation: the hidden state each row's last token was
sampled from, for the first-token re-rank (``first_token``) and the neural fallback (``fallback``).

vLLM hands a custom proposer the committed tokens only; the hidden states reach vLLM's own EAGLE
proposers as arguments of the runner's ``propose_draft_token_ids``. So ``TargetStates.attach`` wraps
that method (vLLM 0.32.0's ``GPUModelRunner``, which the CPU runner inherits; ``versions.py`` pins it) to
keep its 5th and 7th arguments, ``sample_hidden_states`` [num_logits, hidden] and ``spec_decode_metadata``
(None without drafts), while vLLM calls ``propose``: vLLM offers no hook for this, and nothing else in
the adapter wraps the runner. Both readers need the target's whole output embedding on this rank (no
tensor parallelism).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from reprise.backends.vllm.fallback import FallbackPayoff, NeuralFallback
from reprise.backends.vllm.first_token import FirstTokenRerank

log = logging.getLogger(__name__)


class TargetStates:
    """The captured hidden states and what reads them: ``first_token`` re-ranks a chain's first token by
    the target's logits for the tree's roots, ``fallback`` drafts a Medusa head's chain where retrieval's
    expects little (and rests where its calls do not pay: ``payoff``)."""

    def __init__(self, out_embed: Any, first_token: FirstTokenRerank | None, fallback: NeuralFallback | None,
                 health: Any) -> None:
        self.out_embed = out_embed  # the target's output embedding [vocab, hidden]
        self.first_token = first_token
        self.fallback = fallback
        self.payoff = FallbackPayoff()
        self.health = health  # the proposer's ProposerHealth (reranked_steps, fallback_steps)
        self.step: Any = None  # (sample_hidden_states, spec_decode_metadata) of the running step

    @classmethod
    def attach(cls, runner: Any, first_token: FirstTokenRerank | None, fallback: NeuralFallback | None,
               health: Any) -> TargetStates | None:
        """Capture ``runner``'s hidden states for these readers; None when there is none, or no whole
        output embedding on this rank."""
        if first_token is None and fallback is None:
            return None
        out_embed = _output_embedding(runner)
        if out_embed is None:
            log.warning("the first-token re-rank and the neural fallback need the target's whole output "
                        "embedding on this rank: they are off")
            return None
        if fallback is not None:
            fallback.bind(out_embed)
        states = cls(out_embed, first_token, fallback, health)
        original = runner.propose_draft_token_ids
        if getattr(original, "reprise_wrapped", False):
            original = original.reprise_original

        def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
            states.step = (args[4], args[6]) if len(args) >= 7 else None
            try:
                return original(*args, **kwargs)
            finally:
                states.step = None

        propose_draft_token_ids.reprise_wrapped = True  # type: ignore[attr-defined]
        propose_draft_token_ids.reprise_original = original  # type: ignore[attr-defined]
        runner.propose_draft_token_ids = propose_draft_token_ids
        return states

    def rows(self, sampled_token_ids: list[list[int]]) -> Any:
        """Each row's hidden state its last sampled token came from ([num_rows, hidden] float32 copy), or
        None when the step's states were not captured. vLLM computes logits at ``num_draft_tokens + 1``
        positions per row; a row that accepted ``a`` draft tokens sampled ``a + 1`` tokens, the last from
        position ``a`` of its run."""
        if self.step is None:
            return None
        import torch

        states, meta = self.step
        num_rows = len(sampled_token_ids)
        per_row = np.ones(num_rows, dtype=np.int64)
        if meta is not None:
            per_row += np.asarray(meta.num_draft_tokens[:num_rows], dtype=np.int64)
        if len(getattr(meta, "num_draft_tokens", ())) > num_rows or int(per_row.sum()) > int(states.shape[0]):
            return None  # not the layout described above: nothing read this step
        starts = np.concatenate(([0], np.cumsum(per_row)[:-1]))
        sampled = np.fromiter((len(t) for t in sampled_token_ids), dtype=np.int64, count=num_rows)
        return states[torch.from_numpy(starts + np.maximum(sampled - 1, 0))].float()  # vLLM reuses its buffers

    def refine(self, session: Any, chain: Any, hidden: Any, threshold: float, step: int,
               max_len: int) -> tuple[Any, float | None]:
        """``chain`` re-ranked, then replaced by the head's where retrieval's expects fewer accepted tokens
        than ``threshold`` and the head's more; with what the replaced chain expected (None: not replaced)."""
        if self.first_token is not None:
            chain = self._rerank(session, chain, hidden, max_len)
        if self.fallback is None or chain.score >= threshold or not self.payoff.active(step):
            return chain, None
        started = time.perf_counter()
        head = self.fallback.draft(hidden, max_len)
        self.payoff.spent(time.perf_counter() - started)
        if head.score <= chain.score:
            return chain, None
        self.health.fallback_steps += 1
        return session.send_other(head), float(chain.score)

    def settle(self, step: int) -> None:
        """The fallback's payoff, compared now and then (``FallbackPayoff.settle``): a rest where it did not pay."""
        if self.fallback is not None and self.payoff.settle(step):
            self.health.fallback_rests += 1
            log.info("the neural fallback's calls cost more than its chains saved over retrieval's: it rests "
                     "for %d steps", self.payoff.rest_steps)

    def _rerank(self, session: Any, chain: Any, hidden: Any, max_len: int) -> Any:
        import torch

        from retrieval.chain import root_paths

        assert self.first_token is not None
        paths, values = root_paths(session.tree, max_len)
        if len(paths) < 2:
            return chain
        top = paths[: self.first_token.top]
        roots = session.tree.token_ids[[int(p[0]) for p in top]]
        logits = (self.out_embed[torch.from_numpy(roots.astype(np.int64))].float() @ hidden).numpy()
        pick = self.first_token.choose(values[: len(top)], logits)
        if pick == 0:
            return chain
        self.health.reranked_steps += 1
        return session.send(top[pick])


def _output_embedding(runner: Any) -> Any:
    """The target's output embedding ([vocab, hidden] tensor) where this rank holds all of it, else None
    (tensor parallelism shards it; a runner without a model, as in unit tests)."""
    get_model = getattr(runner, "get_model", None)
    head = getattr(get_model() if get_model is not None else None, "lm_head", None)
    weight = getattr(head, "weight", None)
    vocab = getattr(head, "org_vocab_size", None)
    if weight is None or vocab is None or getattr(head, "tp_size", 1) != 1 or weight.shape[0] < vocab:
        return None
    return weight.detach()[:vocab]
