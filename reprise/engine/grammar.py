"""Grammar-constrained decoding composed with speculation (xgrammar, the engine vLLM and SGLang use).

A request with an ``OutputConstraint`` (JSON Schema output, a forced tool call) carries a
``CheckedGrammar``, compiled and measured before decoding (reprise/engine/grammar_compiler.py: a grammar
without a finite output, or one that cannot fit ``max_tokens``, never reaches the engine); the engine
keeps one ``GrammarState`` (a matcher at the committed tokens) per such request and, every step:

1. **jump-forward**: the text the grammar forces next (``{"name": "``, a key, a closing bracket) is
   tokenized and merged into the draft tree as a chain from the root: those tokens are drafted for free,
   whatever the proposer found (only for grammars whose forced strings the compiler bounded);
2. **prune and mask**: xgrammar walks the whole tree from the committed state (``traverse_draft_tree``,
   in C++: one matcher state per node, rolled back between branches) and fills each row's token mask:
   row 0 the committed state's, row i the state after node i. A node whose token its parent's mask
   forbids is dropped with its subtree, so a forbidden draft token is never verified, and so is a node
   after which the grammar allows nothing; ``min_new_tokens`` holds the stop tokens back in these masks
   (see ``GrammarState``), so no row is ever empty;
3. **verify**: the runner applies each row's mask to that row's logits before acceptance
   (``VerifyStep.token_mask``), so greedy output is exactly the constrained greedy output with or
   without drafts, and sampling draws from the constrained distribution;
4. **advance**: the committed tokens move the matcher on.

A state that cannot go on (no token allowed at the committed state, a committed token refused) raises
``GrammarError``; the engine ends that request alone with ``error``.

The cost per step is the matcher's own calls (one tree traversal, one jump-forward lookup, one accept
per committed token) plus a few numpy operations on the tree; requests without a grammar pay nothing.
xgrammar (and torch) are imported lazily: the CLI starts without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from reprise.engine.grammar_compiler import CheckedGrammar, GrammarError
from retrieval.draft_tree import DraftTree, conditional_probs, path_probs, subtree

MAX_FORCED_CHARS_PER_TOKEN = 32  # jump-forward text tokenized per forced token wanted
MAX_FORCED_CHARS = 4096  # a request whose forced text was longer goes on without jump-forward


class GrammarState:
    """One request's grammar at its committed tokens (engine thread only).

    ``min_new_tokens`` / ``suppress_ids``: the request's minimum length. With a grammar the engine, not
    the runner, bans the stop tokens (EOS, stop ids) before that length, in the rows' masks, and only
    where the grammar allows another token: when the grammar is complete and allows nothing but the end,
    the output ends there, shorter than ``min_new_tokens`` (finish reason ``eos``, as for every grammar
    output). So a row's mask is never empty and a token the grammar refuses is never committed.
    Operations that cannot go on raise ``GrammarError`` (``dead_end``); the engine ends that request.
    """

    def __init__(self, grammar: CheckedGrammar, vocab_size: int, tokenizer: Any = None, *, min_new_tokens: int = 0,
                 suppress_ids: Sequence[int] = ()) -> None:
        import torch
        import xgrammar as xgr

        if not isinstance(grammar, CheckedGrammar):
            raise TypeError(f"a request's grammar must come from GrammarCompiler.compile, got {type(grammar).__name__}")
        self._torch = torch
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.jump_forward = grammar.jump_forward
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = np.asarray(sorted(set(self.matcher.stop_token_ids)), dtype=np.int64)
        self.min_new_tokens = min_new_tokens
        self._suppress = np.asarray(sorted({t for t in suppress_ids if 0 <= t < vocab_size}), dtype=np.int64)
        keep_bits = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)  # all but the stop ids
        np.bitwise_and.at(keep_bits, self._suppress >> 5, ~(np.uint32(1) << (self._suppress & 31).astype(np.uint32)))
        self._keep_bits = keep_bits.view(np.int32)
        self.num_committed = 0  # output tokens advanced over (also those after the grammar's end)

    def forced_tokens(self, limit: int) -> list[int]:
        """Tokens of the text the grammar forces next (at most ``limit``), as the tokenizer writes it.

        xgrammar builds the whole forced text, so it is asked only for grammars whose forced strings the
        compiler bounded (``CheckedGrammar.jump_forward``, reprise/engine/grammar_bounds.py), and a
        request whose forced text ran past ``MAX_FORCED_CHARS`` goes on without it (each step would pay
        for text it cannot use). At most ``MAX_FORCED_CHARS_PER_TOKEN`` characters per token are
        tokenized."""
        if limit <= 0 or not self.jump_forward or self.matcher.is_terminated():
            return []
        if self._tokenizer is None:
            # xgrammar 0.2.8 (what vLLM 0.32.0 pins) has no token-level jump forward: none without a tokenizer.
            tokens = getattr(self.matcher, "find_jump_forward_tokens", None)
            return list(tokens())[:limit] if tokens is not None else []
        try:
            text = self.matcher.find_jump_forward_string()
        except UnicodeDecodeError:  # the committed tokens end inside a character: nothing to draft this step
            return []
        if len(text) > MAX_FORCED_CHARS:
            self.jump_forward = False
        text = text[: limit * MAX_FORCED_CHARS_PER_TOKEN]
        return list(self._tokenizer.encode(text, add_special_tokens=False))[:limit] if text else []

    def constrain(self, tree: DraftTree, keep: np.ndarray, room: int,
                  jump_forward: bool = True) -> tuple[DraftTree, np.ndarray, Any]:
        """The draft to verify under the grammar: ``tree`` with the forced chain merged in (at most
        ``room`` nodes in all) and every node the grammar forbids dropped; its ``keep`` (indices in the
        proposer's tree, -1 for forced nodes the proposer did not draft); and the token mask
        ``[1+T, ceil(V/32)]`` int32 of its rows (bit j of word w allows token 32w+j), none of them empty.
        ``GrammarError`` when the grammar allows no token at the committed state."""
        forced = self.forced_tokens(room - len(tree)) if jump_forward else []
        if forced:
            tree, keep = merge_chain(tree, keep, forced)
        parents = np.asarray(tree.parents, dtype=np.int64)
        tokens = np.asarray(tree.token_ids, dtype=np.int64)
        mask = self._torch.zeros((len(tree) + 1, (self.vocab_size + 31) // 32), dtype=self._torch.int32)
        if self.matcher.is_terminated():
            mask.fill_(-1)  # the grammar is complete (past its end token): nothing is constrained
            return tree, keep, mask
        first_child, next_sibling = child_links(parents)
        root_token = np.zeros(1, dtype=np.int64)  # row 0 is the committed state; its token is not read
        self.matcher.traverse_draft_tree(self._torch.from_numpy(first_child), self._torch.from_numpy(next_sibling),
                                         self._torch.from_numpy(np.concatenate((root_token, tokens))), mask)
        words = mask.numpy()  # shares the tensor's memory: edits below are the mask's
        if not words[0].any():
            raise GrammarError(f"the output's grammar allows no token after {self.num_committed} tokens, so the "
                               "output cannot go on (its schema has no valid continuation here)", kind="dead_end")
        if self.num_committed < self.min_new_tokens and len(self._suppress):
            self._hold_back_stops(words, parents)
        valid = np.arange(len(tree))
        if len(tree):
            # A node survives when its parent row allows its token: the traversal leaves the rows of
            # rejected nodes (and of everything below them) all zero, so their children fail the test too.
            bits = (words[parents + 1, tokens >> 5].astype(np.int64) >> (tokens & 31)) & 1
            # A node after which the grammar allows nothing is a dead end, unless it ended the grammar.
            dead_end = ~words[1:].any(axis=1) & ~np.isin(tokens, self._stop_ids)
            valid = np.nonzero(bits.astype(bool) & ~dead_end)[0]
        if len(valid) < len(tree):
            rows = np.concatenate(([0], valid + 1))
            mask = mask[self._torch.from_numpy(rows)]
            words = mask.numpy()
            tree = subtree(tree, valid)
            keep = keep[valid]
        empty = ~words.any(axis=1)  # rows past the grammar's end token: unconstrained (never emitted from)
        if empty.any():
            mask[self._torch.from_numpy(np.nonzero(empty)[0])] = -1
        return tree, keep, mask

    def _hold_back_stops(self, words: np.ndarray, parents: np.ndarray) -> None:
        """Clear the stop tokens' bits in the rows that emit an output token before ``min_new_tokens``
        (row r emits output token ``num_committed + depth(r) + 1``), except in rows allowing nothing else."""
        depths = np.zeros(len(parents) + 1, dtype=np.int64)  # row 0 is the root
        if len(parents):
            depths[1:] = 1
            at = parents.copy()
            while (at >= 0).any():  # one pass per tree level
                depths[1:] += at >= 0
                at = np.where(at >= 0, parents[np.maximum(at, 0)], -1)
        rows = np.nonzero(self.num_committed + depths < self.min_new_tokens)[0]
        held = words[rows] & self._keep_bits
        others = held.any(axis=1)
        words[rows[others]] = held[others]

    def advance(self, token_ids: Sequence[int]) -> None:
        """The committed tokens (drawn under the masks, so the grammar accepts them); ``GrammarError``
        if it does not (the request cannot go on)."""
        for t in token_ids:
            self.num_committed += 1
            if self.matcher.is_terminated():
                continue  # tokens after the grammar's end (ignore_eos) are not constrained
            if not self.matcher.accept_token(int(t)):
                raise GrammarError(f"the output's grammar refused token {int(t)} after {self.num_committed - 1} "
                                   "tokens", kind="dead_end")


def child_links(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First child and next sibling of every row (root + nodes; -1 for none), from parents-first
    ``parents`` (-1 = child of the root): the tree encoding xgrammar's traversal reads. int64 [1+T]."""
    num_rows = len(parents) + 1
    first_child = np.full(num_rows, -1, dtype=np.int64)
    next_sibling = np.full(num_rows, -1, dtype=np.int64)
    if len(parents) == 0:
        return first_child, next_sibling
    parent_rows = parents + 1
    rows = np.arange(1, num_rows)
    order = np.argsort(parent_rows, kind="stable")  # siblings together, in tree order
    sorted_rows, sorted_parents = rows[order], parent_rows[order]
    same = sorted_parents[1:] == sorted_parents[:-1]
    next_sibling[sorted_rows[:-1][same]] = sorted_rows[1:][same]
    starts = np.concatenate(([True], ~same))
    first_child[sorted_parents[starts]] = sorted_rows[starts]
    return first_child, next_sibling


def merge_chain(tree: DraftTree, keep: np.ndarray, chain: Sequence[int]) -> tuple[DraftTree, np.ndarray]:
    """``tree`` with ``chain`` (tokens continuing the committed context) merged in from the root: the
    chain follows existing nodes while their tokens agree, then goes on as new nodes (probability 1: the
    grammar forces them), appended after the existing ones so parents still precede children."""
    parents = [int(p) for p in tree.parents]
    tokens = [int(t) for t in tree.token_ids]
    at = -1
    rest = list(chain)
    while rest:
        child = next((i for i, p in enumerate(parents) if p == at and tokens[i] == rest[0]), None)
        if child is None:
            break
        at = child
        rest.pop(0)
    if not rest:
        return tree, keep
    n = len(tokens)
    new_parents = np.array([at] + list(range(n, n + len(rest) - 1)), dtype=np.int32)
    probs = np.concatenate((conditional_probs(tree).astype(np.float32), np.ones(len(rest), np.float32)))
    reach = float(path_probs(tree)[at]) if at >= 0 else 1.0  # each new node's path probability
    merged = DraftTree(np.concatenate((np.asarray(tree.token_ids, np.int32), np.asarray(rest, np.int32))),
                       np.concatenate((np.asarray(tree.parents, np.int32), new_parents)), probs,
                       float(path_probs(tree).sum()) + reach * len(rest), tree.source if len(tree) else "grammar",
                       tree.match_len)
    return merged, np.concatenate((np.asarray(keep, np.int64), np.full(len(rest), -1, np.int64)))
