"""Multi-source drafting over several indexes in one native call (``csrc/drafter.h``).

``DraftingSession`` owns one request's own indexes (its prompt and output, with real token ids and with
number tokens replaced by class ids) and its context; it drafts from them together with the tenant's
shared indexes (``add_source``) into one best-first tree whose node probabilities come from a
``Calibration`` table that learns, per tenant, how often a candidate with given features (source kind,
match length, count share, newest occurrence, occurrence count) is right; a ``FallbackTable``'s guesses
(the tenant's most frequent next tokens where its indexes' first guesses missed, by a category of the
context's last token) compete with the indexes' nodes for the budget by probability. See the header comment in
``csrc/drafter.h`` for the design and what it was measured against.

Threading: a session is used by one thread at a time; many sessions may draft concurrently from the
same shared indexes (their reader-writer locks are taken shared while drafting); a Calibration may be
shared by all sessions of a tenant.
"""

from __future__ import annotations

import numpy as np

from suffix_index import _native

Calibration = _native.Calibration
DrafterParams = _native.DrafterParams
DraftingSession = _native.DraftingSession
FallbackTable = _native.FallbackTable
#: Fallback categories are below this.
FALLBACK_CATEGORIES: int = _native.FALLBACK_CATEGORIES

#: Source kinds (calibration rows). The session's own indexes use the first two.
KIND_LOCAL: int = _native.KIND_LOCAL
KIND_LOCAL_CANONICAL: int = _native.KIND_LOCAL_CANONICAL
KIND_HISTORY: int = _native.KIND_HISTORY
KIND_HISTORY_CANONICAL: int = _native.KIND_HISTORY_CANONICAL
KIND_CORPUS: int = _native.KIND_CORPUS
KIND_CORPUS_CANONICAL: int = _native.KIND_CORPUS_CANONICAL
KIND_PROMPTS: int = _native.KIND_PROMPTS
KIND_PROMPTS_CANONICAL: int = _native.KIND_PROMPTS_CANONICAL
#: Canonical class ids start here; real token ids must be below it.
CLASS_BASE: int = _native.CLASS_BASE

_registered = False


def register_tree_type(tree_type: type, source: str) -> None:
    """Let ``DraftingSession.propose`` build ``tree_type`` records (retrieval's DraftTree) directly."""
    global _registered
    if _registered:
        return
    e32 = np.zeros(0, dtype=np.int32)
    e32.flags.writeable = False
    f32 = np.zeros(0, dtype=np.float32)
    f32.flags.writeable = False
    _native._register_draft_tree(tree_type, e32, f32, source)
    _registered = True


def native_index(index: object) -> object:
    """The native object behind a ``suffix_index.SuffixIndex`` (for ``DraftingSession.add_source``)."""
    native = getattr(index, "_ix", None)
    if native is None:
        raise TypeError(f"expected a suffix_index.SuffixIndex, got {type(index).__name__}")
    return native
