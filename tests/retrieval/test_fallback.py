"""Fallback guesses: the tenant's most frequent next tokens where its indexes' roots missed, by the shape
of the context's last token, competing with the indexes' nodes for the draft budget. (The table itself
is tested with the native drafter, tests/suffix_index/test_drafting.py.)"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
from test_proposer import check_tree, ids, run_request
from testkit.drafting import verified_along

from retrieval.config import DraftingConfig
from retrieval.proposer import RepriseProposer
from retrieval.vocabulary import token_categories
from suffix_index.drafting import FALLBACK_CATEGORIES


def test_token_categories_follow_the_token_shape() -> None:
    texts = {0: " the", 1: "the", 2: "\n", 3: " 42", 4: ",", 5: ".\n", 6: " of", 7: ""}

    def decode(t: int) -> str:
        if t == 8:
            raise KeyError(t)
        return texts[t]

    cats = token_categories(decode, 9)
    assert cats.dtype == np.uint8 and cats.max() < FALLBACK_CATEGORIES
    assert cats[0] == cats[6]  # two words after a space
    assert len({int(cats[t]) for t in (0, 1, 2, 3, 4, 5)}) == 6
    assert cats[7] == 0 and cats[8] == 0  # empty and undecodable


def _words_proposer(**changes) -> tuple[RepriseProposer, np.ndarray]:
    """Tokens 100.. are fresh words (one category), 5 is " of": every fresh word is followed by " of"."""
    texts = {5: " of", 6: " the", 7: " end"}

    def decode(t: int) -> str:
        return texts.get(t, f" w{t}")

    p = RepriseProposer(dataclasses.replace(DraftingConfig(), collapse_threshold=0.0, **changes))
    p.set_vocabulary(decode, 4000)
    answer = np.array([x for k in range(40) for x in (100 + k, 5, 6)], dtype=np.int32)  # "w of the"...
    return p, answer


def test_a_fresh_word_gets_the_tenants_usual_next_token() -> None:
    p, answer = _words_proposer()
    run_request(p, "t", "a", ids(1, 2, 3), answer)
    s = p.begin("t", "b", ids(1, 2, 3, 3000))  # 3000: a word the tenant never wrote
    tree = s.propose(8)
    check_tree(tree, 8)
    assert tree.source == "reprise:fallback" and tree.token_ids.tolist()[0] == 5
    s.commit(verified_along(tree, ids(5)))
    assert p.history("t").fallback.num_observations > 0
    off, answer = _words_proposer(fallback=False)
    run_request(off, "t", "a", ids(1, 2, 3), answer)
    assert off.history("t").fallback is None
    assert len(off.begin("t", "b", ids(1, 2, 3, 3000)).propose(8)) == 0


def test_guesses_never_repeat_an_index_root_and_give_way_to_sure_copies() -> None:
    p, answer = _words_proposer()
    run_request(p, "t", "a", ids(1, 2, 3), answer)
    for prompt in (ids(1, 2, 3, 100), ids(1, 2, 3, 3000, 5), ids(1, 2, 3, 3001)):
        tree = p.begin("t", "c", prompt).propose(16)
        check_tree(tree, 16)
        roots = tree.token_ids[tree.parents < 0].tolist()
        assert len(roots) == len(set(roots))
    tree = p.begin("t", "d", ids(1, 2, 3)).propose(8)  # the start of the first answer: a copy
    assert tree.token_ids.tolist()[:3] == [100, 5, 6] and tree.source == "reprise:history"
    guesses = tree.parents[3:] < 0
    assert guesses.any()  # the tenant's usual " of" / " the" at the root, after the copy's likelier nodes
    assert tree.probs[3:][guesses].max() <= tree.probs[:3].prod()


def test_guesses_come_from_the_tenants_own_table_only() -> None:
    p, answer = _words_proposer()
    run_request(p, "A", "a", ids(1, 2, 3), answer)
    tree = p.begin("B", "b", ids(1, 2, 3, 3000)).propose(8)
    assert len(tree) == 0  # B saw nothing; A's table is A's


def test_wrong_guesses_do_not_stop_a_tenants_drafting() -> None:
    p, _ = _words_proposer()
    p = RepriseProposer(dataclasses.replace(p.config, collapse_threshold=0.2))
    rng = np.random.default_rng(5)
    run_request(p, "t", "a", ids(1, 2, 3), rng.integers(100, 3000, 400).astype(np.int32))  # nothing repeats
    assert p.history("t").fallback.num_observations > 300
    assert not p.history("t").monitor.suspended  # the monitor weighs the indexes' drafts only


def test_snapshots_keep_the_table_and_read_version_2() -> None:
    p, answer = _words_proposer()
    run_request(p, "t", "a", ids(1, 2, 3), answer)
    data = p.snapshot("t")
    q, _ = _words_proposer()
    q.restore("t", data)
    np.testing.assert_array_equal(q.history("t").fallback.table(), p.history("t").fallback.table())
    a, b = p.begin("t", "x", ids(1, 2, 3000)).propose(8), q.begin("t", "x", ids(1, 2, 3000)).propose(8)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    # a version 2 snapshot: the same parts without the fallback table
    body = data[:-4]
    (n_last,) = struct.unpack("<Q", body[-(8 + len(p.history("t").fallback.table()) * 8):][:8])
    old = bytearray(body[: len(body) - 8 - n_last])
    old[4:8] = struct.pack("<I", 2)
    old += struct.pack("<I", zlib.crc32(bytes(old)))
    r, _ = _words_proposer()
    r.restore("t", bytes(old))
    assert r.history("t").fallback.num_observations == 0
    assert r.index_stats("t").num_history_tokens == p.index_stats("t").num_history_tokens
