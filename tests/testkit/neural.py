"""Helpers of the neural drafter tests: randomly initialised heads, the target's hidden states."""

from __future__ import annotations

import torch

from neural_drafters.config import HeadConfig
from neural_drafters.heads import TargetParts, build_head

VOCAB = 128


def random_head(model, kind: str, *, num_heads: int = 1, draft_vocab: int | None = None, seed: int = 0,
                std: float = 0.1):
    """A head of ``kind`` for ``model`` with random weights (drafts are arbitrary, which exactness
    tests want) and its target parts."""
    config = HeadConfig.for_target(model.config, kind, num_heads=num_heads, draft_vocab_size=draft_vocab)
    head = build_head(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=generator) * std)
        if draft_vocab is not None:
            head.d2t.copy_(torch.randperm(config.vocab_size, generator=generator)[:draft_vocab].sort().values)
    return head.eval(), TargetParts.from_model(model, head.d2t)


def hidden_of(model, ids: list[int]) -> torch.Tensor:
    """The target's top hidden states ``[len(ids), d]`` (post final norm)."""
    with torch.inference_mode():
        return model.base_model(torch.tensor([ids])).last_hidden_state[0].float()
