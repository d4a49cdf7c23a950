"""Retrieval drafters over the native index; the DraftTree contract."""

from __future__ import annotations

from retrieval.draft_tree import DraftTree

__all__ = ["DraftTree"]
