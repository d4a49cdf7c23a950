"""Native suffix index: per-tenant suffix tree with counts, exact-key index, serialization."""

from __future__ import annotations

from suffix_index import _native  # noqa: F401
