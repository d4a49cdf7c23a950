"""Tenant scoping (docs/architecture.md, "Contracts"): a tenant's drafts come only from its own history, corpus and
current request. Property: no draft token transition that exists only in another tenant's text is ever
proposed."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.registry import make_proposer
from retrieval.session import Verified

VOCAB = 12  # small, so that tenants share tokens and contexts collide often

seqs = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=40)


def transitions(*texts: list[int]) -> set[tuple[int, int]]:
    return {(a, b) for t in texts for a, b in itertools.pairwise(t)}


def drafted_transitions(tree, last: int) -> set[tuple[int, int]]:
    """(previous token, drafted token) for every node: the context's last token for roots."""
    out = set()
    for i, (tok, parent) in enumerate(zip(tree.token_ids.tolist(), tree.parents.tolist())):
        out.add((last if parent < 0 else int(tree.token_ids[parent]), tok))
    return out


@settings(max_examples=60, deadline=None)
@given(a_history=st.lists(seqs, min_size=1, max_size=4), b_history=st.lists(seqs, max_size=4),
       b_corpus=st.lists(seqs, max_size=2), b_prompt=seqs, name=st.sampled_from(["reprise", "suffix", "exact_key",
                                                                                 "suffixdecoding"]))
def test_drafts_never_use_another_tenants_history(a_history, b_history, b_corpus, b_prompt, name) -> None:
    p = make_proposer(name)
    for k, text in enumerate(a_history):  # tenant A records its turns
        s = p.begin("A", f"a{k}", np.array(text[:1], dtype=np.int32))
        s.commit(Verified.tokens(np.array(text[1:], dtype=np.int32)))
        s.finish()
    for k, text in enumerate(b_history):
        s = p.begin("B", f"b{k}", np.array(text[:1], dtype=np.int32))
        s.commit(Verified.tokens(np.array(text[1:], dtype=np.int32)))
        s.finish()
    if b_corpus and hasattr(p, "add_corpus"):
        p.add_corpus("B", [np.array(c, dtype=np.int32) for c in b_corpus])
    # lead-ins are prompt tails: B's history texts include their prompt token
    allowed = transitions(*b_history, *(b_corpus if hasattr(p, "add_corpus") else []), b_prompt)
    s = p.begin("B", "now", np.array(b_prompt, dtype=np.int32))
    tree = s.propose(16)
    assert drafted_transitions(tree, b_prompt[-1]) <= allowed
