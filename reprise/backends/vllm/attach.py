"""Starting Reprise's proposer in vLLM's worker: the model folder, the vocabulary, ``reprise_attach``.

The service's wiring (``reprise.server.vllm``) and ``reprise bench engine`` both start it this way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reprise.backends.vllm.engine import VllmEngine
from reprise.backends.vllm.first_token import FirstTokenRerank
from reprise.backends.vllm.proposer import DEFAULT_STALL_TIMEOUT_S

CHAIN_TREE_FACTOR = 2  # retrieval.chain: a chain is the best path of a tree this many times its length
MAX_SPECULATIVE_TOKENS = 32
# The chain's first token re-ranked by the target's logits between the drafter's two best roots (docs/vllm.md,
# "Chains, not trees": measured on two agents' traces, wider choices lost).
FIRST_TOKEN = FirstTokenRerank(top=2, weight=1.0)


def model_folder(path: str) -> str:
    """``path``, or the default model's safetensors folder (converted on first use)."""
    if path:
        return str(Path(path).expanduser())
    from verifier.models import ensure_default_model

    return str(ensure_default_model())


def vocabulary(tokenizer: Any) -> list[str]:
    """Each token id's text, for canonical number matching in the worker (``set_vocabulary``)."""
    return [tokenizer.decode([i]) for i in range(len(tokenizer))]


def attach_reprise(engine: VllmEngine, drafting: Any, tokenizer: Any, *, adaptive: bool = True,
                   stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                   first_token: FirstTokenRerank | None = FIRST_TOKEN, fallback_head: str | Path | None = None) -> None:
    """Start Reprise's proposer in every worker with ``drafting`` (a ``DraftingConfig``); ``first_token``
    re-ranks each chain's first token by the target's logits (None: the drafter's order);
    ``fallback_head``: a Medusa checkpoint that drafts where retrieval has little (``fallback``)."""
    words = vocabulary(tokenizer) if tokenizer is not None else None
    rerank = (first_token.top, first_token.weight) if first_token is not None else None
    engine.rpc("reprise_attach", drafting.to_dict(), words, CHAIN_TREE_FACTOR, stall_timeout_s, adaptive, rerank,
               str(fallback_head) if fallback_head is not None else None)
