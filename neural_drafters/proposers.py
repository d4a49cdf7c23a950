"""Building the neural, hidden-state reuse and hybrid proposers: checkpoint loading and registry factories.

Proposers are made from a ``DraftingConfig`` alone, so the head's
checkpoint is found by convention: ``$REPRISE_DRAFTER_CHECKPOINT``, else
``$REPRISE_HOME/drafters/default`` (where ``reprise train-drafter`` writes by default). Its embeddings and
``lm_head`` rows come from the target folder recorded in the checkpoint (read from its safetensors, no
model built), or from a loaded model passed to ``load_neural_proposer``.

The application's registry (reprise/drafters.py) makes them by the names ``neural``, ``hidden_reuse``
and ``hybrid``. A missing or unreadable checkpoint is a logged warning: ``hybrid`` then drafts by retrieval (and hidden-state reuse)
alone, ``neural`` drafts nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from fileio import reprise_home
from neural_drafters.checkpoint import load_head
from neural_drafters.drafting import DraftSettings, HeadDrafter
from neural_drafters.heads import MTPHead, TargetParts
from neural_drafters.hybrid import (
    DEFAULT_THRESHOLD,
    HybridProposer,
    HybridSettings,
    NeuralProposer,
    ReuseProposer,
)
from neural_drafters.reuse import HiddenStateMemory
from retrieval.draft_tree import DraftTree
from retrieval.registry import DEFAULT_DRAFTER, make_proposer

log = logging.getLogger(__name__)

CHECKPOINT_ENV = "REPRISE_DRAFTER_CHECKPOINT"


def default_checkpoint() -> Path:
    """``$REPRISE_DRAFTER_CHECKPOINT``, else ``$REPRISE_HOME/drafters/default``."""
    env = os.environ.get(CHECKPOINT_ENV)
    return Path(env).expanduser() if env else reprise_home() / "drafters" / "default"


def load_head_drafter(checkpoint: str | Path, *, model: Any = None, settings: Any = None) -> Any:
    """A ``HeadDrafter`` from a checkpoint; the target's weights from ``model`` or the recorded folder.

    Raises FileNotFoundError / ValueError naming what is wrong (missing checkpoint, other target shape).
    """
    head, _info = load_head(checkpoint)
    config = head.config
    if model is not None:
        config.check_target(model.config)
        parts = TargetParts.from_model(model, head.d2t)
    else:
        if not config.target:
            raise ValueError(f"checkpoint {checkpoint} records no target folder: pass the target model")
        parts = TargetParts.from_folder(config.target, head.d2t)
    if isinstance(head, MTPHead) and not config.hidden_post_norm:
        if parts.final_norm is None:
            raise ValueError("MTP modules trained on pre-norm states need the target's final norm weight")
        head.set_post_norm_inputs(parts.final_norm)
    return HeadDrafter(head, parts, settings or DraftSettings())


def load_neural_proposer(checkpoint: str | Path | None = None, *, model: Any = None,
                         settings: Any = None) -> NeuralProposer | None:
    """The neural proposer, or None (with a logged warning) when the checkpoint is missing or unusable."""
    path = Path(checkpoint) if checkpoint is not None else default_checkpoint()
    try:
        return NeuralProposer(load_head_drafter(path, model=model, settings=settings))
    except (FileNotFoundError, ValueError, OSError, KeyError) as exc:
        log.warning("no neural drafter (%s); drafting without it", exc)
        return None


class _Nothing:
    """A proposer whose sessions draft nothing (the neural proposer without a head)."""

    def begin(self, tenant: str, session_id: str, prompt_ids: Any, request_id: str = "") -> Any:
        return self

    def propose(self, budget: int) -> Any:
        return DraftTree.empty("neural")

    def commit(self, verified: Any) -> None:
        pass

    def finish(self, record: bool = True) -> None:
        pass


def make_neural_proposer(config: Any) -> Any:
    """Registry factory: the head alone (drafts nothing, with a warning, when there is no checkpoint)."""
    proposer = load_neural_proposer()
    return proposer if proposer is not None else _Nothing()


def make_reuse_proposer(config: Any) -> ReuseProposer:
    """Registry factory: hidden-state keyed reuse alone (memory per tenant, in this process)."""
    return ReuseProposer(HiddenStateMemory())


def make_hybrid_proposer(config: Any) -> HybridProposer:
    """Registry factory: retrieval + reuse + neural; the threshold is ``config.hybrid_threshold`` when the
    drafting settings have that field, else the default."""
    threshold = float(getattr(config, "hybrid_threshold", DEFAULT_THRESHOLD))
    retrieval = make_proposer(DEFAULT_DRAFTER, config)
    return HybridProposer(retrieval, load_neural_proposer(), ReuseProposer(HiddenStateMemory()),
                          HybridSettings(threshold=threshold))
