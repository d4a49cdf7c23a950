"""Native suffix index: a depth-capped suffix trie with occurrence counts per node, an exact-key index,
byte-budget eviction and serialization, behind a typed facade (see ``SuffixIndex``)."""

from __future__ import annotations

from suffix_index import _native  # noqa: F401
from suffix_index.index import DEFAULT_KEY_LENGTHS, MAX_DEPTH_LIMIT, Draft, SuffixIndex, as_tokens

__all__ = ["DEFAULT_KEY_LENGTHS", "MAX_DEPTH_LIMIT", "Draft", "SuffixIndex", "as_tokens"]
