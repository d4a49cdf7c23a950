"""Shared steps of the suffix index tests: applying a random operation, a draft against the oracle's,
two indexes that must be indistinguishable."""

from __future__ import annotations

import math

import numpy as np

from suffix_index import SuffixIndex


def apply_op(ix: SuffixIndex, op: tuple) -> None:
    """One ("add" | "extend" | "remove", seq_id, tokens) operation; an add of a present id and a remove of
    an absent one are skipped."""
    kind, sid, toks = op
    if kind == "add" and sid not in ix:
        ix.add(sid, toks)
    elif kind == "extend":
        ix.extend(sid, toks)
    elif kind == "remove" and sid in ix:
        ix.remove(sid)


def assert_same_draft(draft, expected, where: str) -> None:
    nodes, score, match_len = expected
    assert draft.token_ids.tolist() == [t for t, _, _ in nodes], where
    assert draft.parents.tolist() == [p for _, p, _ in nodes], where
    assert draft.probs.tolist() == np.array([p for _, _, p in nodes], dtype=np.float32).tolist(), where
    assert math.isclose(draft.score, score, rel_tol=1e-12, abs_tol=0.0), where
    assert draft.match_len == match_len, where


def same_index(a: SuffixIndex, b: SuffixIndex, contexts) -> None:
    b.check_integrity()
    assert (a.max_depth, a.max_bytes, a.key_lengths) == (b.max_depth, b.max_bytes, b.key_lengths)
    assert a.sequence_ids().tolist() == b.sequence_ids().tolist()
    for sid in a.sequence_ids().tolist():
        assert a.get_sequence(sid).tolist() == b.get_sequence(sid).tolist()
    logical = ("nodes", "child_slots", "tokens", "sequences", "tail_slots", "keys", "memory_bytes")
    sa, sb = a.stats(), b.stats()
    assert {k: sa[k] for k in logical} == {k: sb[k] for k in logical}
    for ctx in contexts:
        for tree in (False, True):
            da, db = a.speculate(ctx, 6, use_tree=tree), b.speculate(ctx, 6, use_tree=tree)
            assert (da.token_ids.tolist(), da.probs.tolist(), da.score, da.match_len) == (
                db.token_ids.tolist(),
                db.probs.tolist(),
                db.score,
                db.match_len,
            )
        ea, eb = a.speculate_exact(ctx, 10), b.speculate_exact(ctx, 10)
        assert (ea.token_ids.tolist(), ea.probs.tolist(), ea.match_len) == (
            eb.token_ids.tolist(),
            eb.probs.tolist(),
            eb.match_len,
        )
