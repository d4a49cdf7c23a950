"""Single-source drafters: the SuffixDecoding anchor, exact keys, and the drafter protocol."""

from __future__ import annotations

import numpy as np
import pytest
from testkit.drafting import verified_along

from retrieval.drafters import ExactKeyProposer, SuffixDecodingProposer
from retrieval.registry import make_proposer
from retrieval.session import Verified


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def walk(tree, truth) -> int:
    at, n = -1, 0
    while n < len(truth):
        kids = [i for i, p in enumerate(tree.parents) if p == at and tree.token_ids[i] == truth[n]]
        if not kids:
            return n
        at, n = kids[0], n + 1
    return n


def test_suffixdecoding_anchor_matches_the_whole_context() -> None:
    p = SuffixDecodingProposer()
    # The anchor's own loop stops one short: with the context equal to an indexed string's first three
    # tokens, it would never use the 3-token match. Ours does.
    s = p.begin("t", "a", ids(1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3))
    tree = s.propose(4)
    assert walk(tree, [4]) == 1
    assert tree.match_len == 3


def test_suffixdecoding_picks_the_higher_scoring_source() -> None:
    p = SuffixDecodingProposer()
    s = p.begin("t", "a", ids(8, 8, 8))
    s.commit(Verified.tokens(ids(1, 2, 3, 4, 5, 6)))
    s.finish()
    s = p.begin("t", "b", ids(9, 1, 2))  # only the history has "1 2 -> 3 4 5 6"
    assert walk(s.propose(8), [3, 4, 5, 6]) == 4


def test_exact_key_copies_the_newest_occurrence() -> None:
    p = ExactKeyProposer()
    s = p.begin("t", "a", ids(1, 2, 3, 4, 10, 11, 12, 13, 1, 2, 3, 4, 20, 21, 22, 23, 9, 1, 2, 3, 4))
    tree = s.propose(4)
    assert tree.token_ids.tolist() == [20, 21, 22, 23]  # the newer of the two continuations
    assert tree.source == "exact_key"


@pytest.mark.parametrize("name", ["reprise", "suffix", "corpus", "exact_key", "suffixdecoding", "prompt_lookup"])
def test_every_drafter_follows_the_session_contract(name: str) -> None:
    p = make_proposer(name)
    rng = np.random.default_rng(4)
    for k in range(3):
        s = p.begin("t", f"s{k}", rng.integers(0, 30, 20).astype(np.int32))
        for _ in range(5):
            tree = s.propose(8)
            assert len(tree) <= 8
            tree.validate()
            s.commit(verified_along(tree, rng.integers(0, 30, 3).astype(np.int32)))
        assert len(s.propose(0)) == 0
        s.finish(record=k % 2 == 0)
