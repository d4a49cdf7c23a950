"""Hot-spot kernels of the verifier, each a Triton kernel beside a pure-torch reference with the same
signature: tree-masked attention over the KV cache, and accept-and-compact of the KV cache.

Dispatch (``backend="auto"``): Triton on CUDA tensors, the torch reference on CPU. Tests run the Triton
kernels on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported) against the references.
Triton is an optional extra: the kernel modules import it inside the functions that compile or launch a
kernel, never at module top.
"""

from __future__ import annotations

from verifier.kernels.compact import compact_kv, compact_kv_reference, compact_kv_triton
from verifier.kernels.tree_attention import tree_attention, tree_attention_reference, tree_attention_triton


def triton_available() -> bool:
    """True when triton imports (the ``triton`` extra is installed)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "compact_kv",
    "compact_kv_reference",
    "compact_kv_triton",
    "tree_attention",
    "tree_attention_reference",
    "tree_attention_triton",
    "triton_available",
]
