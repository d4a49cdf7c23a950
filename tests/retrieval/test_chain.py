"""retrieval.chain: the best path of a draft tree, and chain sessions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from retrieval.chain import ChainProposer, best_path, best_path_per_root
from retrieval.draft_tree import DraftTree
from retrieval.proposer import RepriseProposer
from retrieval.session import Verified


def _tree(parents, probs, path_probs=False):
    parents = np.asarray(parents, dtype=np.int32)
    probs = np.asarray(probs, dtype=np.float32)
    chained = probs.astype(np.float64).copy()
    for i, p in enumerate(parents):
        if p >= 0:
            chained[i] *= chained[p]
    ids = np.arange(100, 100 + len(parents), dtype=np.int32)
    stored = chained.astype(np.float32) if path_probs else probs
    return DraftTree(ids, parents, stored, float(chained.sum()), "t")


def _brute_force(parents, probs, max_len):
    """Every root path's expected accepted count (sum of path probabilities), the best one."""
    n = len(parents)
    best, best_nodes = -1.0, []
    for leaf in range(n):
        nodes, node = [], leaf
        while node >= 0:
            nodes.append(node)
            node = parents[node]
        nodes.reverse()
        if len(nodes) > max_len:
            continue
        value = float(np.cumprod([probs[i] for i in nodes]).sum())
        if value > best + 1e-9:
            best, best_nodes = value, nodes
    return best, best_nodes


@st.composite
def trees(draw):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
    probs = [draw(st.floats(0.05, 1.0)) for _ in range(n)]
    return parents, probs


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(1, 6), st.booleans())
def test_best_path_is_the_root_path_with_the_most_expected_accepted_tokens(tree, max_len, as_path_probs):
    parents, probs = tree
    t = _tree(parents, probs, path_probs=as_path_probs)
    chain = best_path(t, max_len)
    value, nodes = _brute_force(parents, probs, max_len)
    assert len(chain) <= max_len
    assert chain.parents.tolist() == list(range(-1, len(chain) - 1))
    assert chain.score == pytest.approx(value, rel=1e-5)
    if not any(abs(v - value) < 1e-6 for v in _all_values(parents, probs, max_len, exclude=nodes)):
        assert chain.token_ids.tolist() == [100 + i for i in nodes]


def _all_values(parents, probs, max_len, exclude):
    for leaf in range(len(parents)):
        nodes, node = [], leaf
        while node >= 0:
            nodes.append(node)
            node = parents[node]
        nodes.reverse()
        if nodes != exclude and len(nodes) <= max_len:
            yield float(np.cumprod([probs[i] for i in nodes]).sum())


def test_best_path_of_empty_trees_and_chains():
    assert len(best_path(DraftTree.empty("x"), 8)) == 0
    chain = DraftTree.chain([5, 6, 7], [0.9, 0.9, 0.9])
    assert best_path(chain, 8) is chain
    assert best_path(chain, 2).token_ids.tolist() == [5, 6]
    assert len(best_path(chain, 0)) == 0


def test_chain_sessions_send_paths_and_keep_drafting_from_history():
    proposer = ChainProposer(RepriseProposer(), tree_factor=2)
    text = [int(t) for t in itertools.islice(itertools.cycle([11, 12, 13, 14, 15, 16, 17, 18, 19]), 60)]
    for turn in range(2):
        session = proposer.begin("acme", f"s{turn}", [1, 2, 3])
        pos, drafted = 0, 0
        while pos < len(text):
            tree = session.propose(8)
            assert len(tree) <= 8
            assert tree.parents.tolist() == list(range(-1, len(tree) - 1))
            k = 0
            while k < len(tree) and pos + k < len(text) and tree.token_ids[k] == text[pos + k]:
                k += 1
            drafted += k
            end = min(pos + k + 1, len(text))
            session.commit(Verified(np.asarray(text[pos:end], dtype=np.int32), np.arange(k, dtype=np.int32),
                                    len(tree) > 0))
            pos = end
        session.finish(record=True)
    assert drafted > 40  # the second turn copies the first from the tenant's history


def test_chain_proposer_rejects_a_bad_factor():
    with pytest.raises(ValueError, match="tree_factor"):
        ChainProposer(RepriseProposer(), tree_factor=0)


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(1, 6))
@example(([-1, -1, 1], [0.9999999999999999, 0.5, 1.0]), 2)  # two roots' values equal but for rounding
def test_best_path_per_root_gives_each_roots_best_path_best_first(tree, max_len):
    parents, probs = tree
    t = _tree(parents, probs)
    paths = best_path_per_root(t, max_len)
    roots = [i for i, p in enumerate(parents) if p < 0]
    assert sorted(int(p[0]) for p in paths) == roots  # one path per root, starting at it
    values = []
    for path in paths:
        assert len(path) <= max_len
        assert all(parents[int(b)] == int(a) for a, b in itertools.pairwise(path))  # a root path
        value = float(np.cumprod([probs[int(i)] for i in path]).sum())
        # no path under the same root is better
        for leaf in range(len(parents)):
            nodes, node = [], leaf
            while node >= 0:
                nodes.append(node)
                node = parents[node]
            if nodes[-1] == int(path[0]) and len(nodes) <= max_len:
                assert float(np.cumprod([probs[i] for i in nodes[::-1]]).sum()) <= value + 1e-6
        values.append(value)
    # best first, to float rounding: the test sums each path's probabilities in another order
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(values))
    assert best_path(t, max_len).token_ids.tolist() == t.token_ids[paths[0]].tolist()  # the chain sent


def test_best_path_per_root_of_an_empty_tree_is_empty():
    assert best_path_per_root(DraftTree.empty("t"), 4) == []
    assert best_path_per_root(_tree([-1, 0], [0.5, 0.5]), 0) == []
