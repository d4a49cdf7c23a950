"""Plugging tree attention into transformers models.

The runner sets the model's attention implementation to ``reprise_tree`` (registered in transformers'
``AttentionInterface``) and passes a :class:`TreeAttentionMeta` through the forward's keyword arguments,
which transformers hands down to every attention call. Called without it (e.g. by ``generate``), the
function falls back to transformers' SDPA attention, and the name is registered with SDPA's mask
builder too, so the model stays a correct plain model (without the mask builder, transformers builds
no mask for an unknown name and multi-token calls such as prompt lookup silently attend upper-left
causally: wrong output).

The runner passes a placeholder 4D mask, which transformers hands through untouched: the tree
structure travels in the metadata, and no ``[B, 1, Q, L]`` mask is built per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from verifier.kernels.tree_attention import tree_attention

ATTENTION_NAME = "reprise_tree"
META_KWARG = "reprise_tree"


@dataclass(frozen=True, slots=True)
class TreeAttentionMeta:
    """Per-forward tree structure for the attention kernel (see verifier/kernels/tree_attention.py)."""

    prefix_lens: torch.Tensor  # [B] int32, on the model's device
    tree_mask: torch.Tensor  # [B, Q, Q] bool
    backend: str  # "triton" or "torch"
    mask: torch.Tensor | None = None  # [B, 1, Q, L] float additive mask for "torch", built once per forward
    causal: bool = False  # the rows are one chain from position 0 (a prompt's first chunk): no mask at all


def reprise_tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface signature; returns ``([B, Q, Hq, D], None)``."""
    meta = kwargs.get(META_KWARG)
    if meta is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if meta.causal and meta.backend == "torch":  # SDPA's causal kernel: ~1/3 faster than a float mask here
        return sdpa_causal(query, key, value, scale), None
    out = tree_attention(
        query, key, value, meta.prefix_lens, meta.tree_mask, scale, backend=meta.backend, mask=meta.mask
    )
    return out.transpose(1, 2), None


def sdpa_causal(query, key, value, scale: float):
    """Plain causal attention of one chain from position 0 (``[B, Hq, Q, D]`` with ``Q`` keys) ->
    ``[B, Q, Hq, D]``."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2)


_registered = False


def register() -> str:
    """Register ``reprise_tree`` with transformers (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, reprise_tree_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME
