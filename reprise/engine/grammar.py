"""Grammar-constrained decoding composed with speculation (xgrammar, the engine vLLM and SGLang use).

A request with an ``OutputConstraint`` (JSON Schema output, a forced tool call) carries a compiled
grammar; the engine keeps one ``GrammarState`` (a matcher at the committed tokens) per such request and,
every step:

1. **jump-forward**: the text the grammar forces next (``{"name": "``, a key, a closing bracket) is
   tokenized and merged into the draft tree as a chain from the root: those tokens are drafted for free,
   whatever the proposer found;
2. **prune and mask**: xgrammar walks the whole tree from the committed state (``traverse_draft_tree``,
   in C++: one matcher state per node, rolled back between branches) and fills each row's token mask:
   row 0 the committed state's, row i the state after node i. A node whose token its parent's mask
   forbids is dropped with its subtree, so a forbidden draft token is never verified;
3. **verify**: the runner applies each row's mask to that row's logits before acceptance
   (``VerifyStep.token_mask``), so greedy output is exactly the constrained greedy output with or
   without drafts, and sampling draws from the constrained distribution;
4. **advance**: the committed tokens move the matcher on.

The cost per step is the matcher's own calls (one tree traversal, one jump-forward lookup, one accept
per committed token) plus a few numpy operations on the tree; requests without a grammar pay nothing.
xgrammar (and torch) are imported lazily: the CLI starts without them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from retrieval.draft_tree import DraftTree, conditional_probs, path_probs, subtree
from serving.records import OutputConstraint

MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Compiles ``OutputConstraint`` records for one tokenizer (cached: agents repeat their schemas)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr  # lazy: it imports torch and takes seconds

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[OutputConstraint, Any] = OrderedDict()
        self._lock = threading.Lock()  # worker threads compile concurrently
        self.vocab_size = vocab_size

    def compile(self, constraint: OutputConstraint) -> Any:
        """The compiled grammar; ValueError naming the constraint when its schema cannot be compiled."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        xgr = self._xgr
        try:
            # Compact JSON with json.dumps' separators: no free whitespace for a model to loop in, and the
            # same text a reply sent back in a later request renders to (serving/tool_calls.py).
            body = xgr.Grammar.from_json_schema(constraint.schema, any_whitespace=False)
            parts = [xgr.Grammar.from_ebnf(f"root ::= {_literal(constraint.prefix)}")] if constraint.prefix else []
            parts.append(body)
            if constraint.suffix:
                parts.append(xgr.Grammar.from_ebnf(f"root ::= {_literal(constraint.suffix)}"))
            grammar = xgr.Grammar.concat(*parts) if len(parts) > 1 else body
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for bad schemas
            raise ValueError(f"the {constraint.name} schema cannot be used as a grammar: {exc}") from None
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


class GrammarState:
    """One request's grammar at its committed tokens (engine thread only)."""

    def __init__(self, compiled: Any, vocab_size: int, tokenizer: Any = None) -> None:
        import torch
        import xgrammar as xgr

        self._torch = torch
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer

    def forced_tokens(self, limit: int) -> list[int]:
        """Tokens of the text the grammar forces next (at most ``limit``), as the tokenizer writes it."""
        if limit <= 0 or self.matcher.is_terminated():
            return []
        if self._tokenizer is None:
            # xgrammar 0.2.8 (what vLLM 0.32.0 pins) has no token-level jump forward: none without a tokenizer.
            tokens = getattr(self.matcher, "find_jump_forward_tokens", None)
            return list(tokens())[:limit] if tokens is not None else []
        text = self.matcher.find_jump_forward_string()
        return list(self._tokenizer.encode(text, add_special_tokens=False))[:limit] if text else []

    def constrain(self, tree: DraftTree, keep: np.ndarray, room: int,
                  jump_forward: bool = True) -> tuple[DraftTree, np.ndarray, Any]:
        """The draft to verify under the grammar: ``tree`` with the forced chain merged in (at most
        ``room`` nodes in all) and every node the grammar forbids dropped; its ``keep`` (indices in the
        proposer's tree, -1 for forced nodes the proposer did not draft); and the token mask
        ``[1+T, ceil(V/32)]`` int32 of its rows (bit j of word w allows token 32w+j)."""
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
        words = mask.numpy()
        if len(tree):
            # A node survives when its parent row allows its token: the traversal leaves the rows of
            # rejected nodes (and of everything below them) all zero, so their children fail the test too.
            parent_rows = parents + 1
            bits = (words[parent_rows, tokens >> 5].astype(np.int64) >> (tokens & 31)) & 1
            valid = np.nonzero(bits)[0]
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

    def advance(self, token_ids: Sequence[int]) -> None:
        """The committed tokens (drawn under the masks, so the grammar accepts them)."""
        for t in token_ids:
            if self.matcher.is_terminated():
                return  # tokens after the grammar's end (ignore_eos) are not constrained
            if not self.matcher.accept_token(int(t)):
                raise RuntimeError(f"the grammar rejected committed token {int(t)}: its mask was not applied")


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
