"""Shared comparison for suffix index tests: two indexes that must be indistinguishable."""

from __future__ import annotations

from suffix_index import SuffixIndex


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
