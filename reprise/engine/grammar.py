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

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpc_api.backend import OutputConstraint
from reprise.engine.grammar_bounds import GrammarBounds, NoFiniteOutput, UnsupportedGrammar, measure
from retrieval.draft_tree import DraftTree, conditional_probs, path_probs, subtree

MAX_CONSTRAINT_CHARS = 1 << 20  # a constraint's schema text (every tool's parameters together)
MAX_SCHEMA_DEPTH = 64  # nesting of the schema's JSON (tool calls add 3 levels)
MAX_GRAMMAR_RULES = 100_000  # rules of the converted grammar, regex expansions included
MAX_FORCED_CHARS_PER_TOKEN = 32  # jump-forward text tokenized per forced token wanted
MAX_CACHED_TENANTS = 64  # tenants whose compiled grammars are kept (least recently used go first)
MAX_CACHED_PER_TENANT = 32  # compiled grammars kept per tenant


class GrammarError(ValueError):
    """A constraint the engine cannot decode under, said in the client's terms. ``kind``:
    ``too_large`` (the schema's size or nesting), ``unsupported`` (xgrammar cannot convert it),
    ``no_finite_output`` (a part admits no finite value), ``does_not_fit`` (its shortest output, or one
    of its parts, needs more than ``max_tokens``), ``dead_end`` (at decode time: the grammar allows no
    next token). ``tool``: the tool whose parameters caused it (None: the response format's schema, or
    the call object)."""

    def __init__(self, message: str, *, kind: str, tool: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.tool = tool


@dataclass(frozen=True, slots=True)
class CheckedGrammar:
    """A compiled grammar (``xgrammar.CompiledGrammar``) that passed ``GrammarCompiler``'s checks, with
    its bounds: what ``GenerationRequest.grammar`` carries, and the only thing ``GrammarState`` takes, so
    the engine thread never starts on a grammar nobody measured."""

    compiled: Any
    bounds: GrammarBounds


@dataclass(slots=True)
class _Entry:
    """One tenant's measured (and, once decoded under, compiled) constraint."""

    bounds: GrammarBounds  # of the whole output: prefix, schema value, suffix
    shortest_tokens: int  # tokens of a shortest complete output (the tokenizer's count)
    grammar: CheckedGrammar | None = None


class GrammarCompiler:
    """Measures and compiles ``OutputConstraint`` records for one tokenizer.

    ``compile(constraint, tenant=..., max_tokens=...)`` refuses (``GrammarError``) a schema that is too
    large, that xgrammar cannot convert, whose grammar has a part without a finite value, or whose
    shortest complete output (or one of whose parts) needs more than ``max_tokens``; so decoding never
    starts on a grammar that cannot end (reprise/engine/grammar_bounds.py). Compiled grammars are cached
    per tenant (agents repeat their schemas): a tenant never gets a hit on another tenant's schema, so
    compile times do not reveal what others sent, and xgrammar's own cache, which would be shared, is off.
    Runs on the caller's (worker) thread; thread-safe.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr  # lazy: it imports torch and takes seconds

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._tokenizer = tokenizer
        # The most bytes one token writes: a part longer than max_tokens times this can never be emitted.
        self.max_token_bytes = max((len(piece) for piece in info.decoded_vocab), default=1) or 1
        self._cache: OrderedDict[str, OrderedDict[OutputConstraint, _Entry]] = OrderedDict()
        self._lock = threading.Lock()  # worker threads compile concurrently
        self.vocab_size = vocab_size
        self.hits = 0
        self.misses = 0

    def compile(self, constraint: OutputConstraint, *, tenant: str, max_tokens: int) -> CheckedGrammar:
        """The compiled grammar of ``constraint`` for ``tenant``'s request of at most ``max_tokens``
        output tokens; ``GrammarError`` (a ValueError) saying why when it cannot be decoded under."""
        entry = self._entry(constraint, tenant, max_tokens)
        if entry.grammar is None:
            try:
                compiled = self._compiler.compile_grammar(self._grammar(constraint))
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for what it cannot build
                raise GrammarError(f"{_label(constraint, None)} cannot be used as a grammar: {_clean(exc)}",
                                   kind="unsupported") from None
            entry.grammar = CheckedGrammar(compiled, entry.bounds)
        return entry.grammar

    def check(self, constraint: OutputConstraint, *, tenant: str, max_tokens: int) -> GrammarBounds:
        """``compile``'s checks without compiling (for an engine that compiles the grammar itself)."""
        return self._entry(constraint, tenant, max_tokens).bounds

    def _entry(self, constraint: OutputConstraint, tenant: str, max_tokens: int) -> _Entry:
        with self._lock:
            cached = self._cache.get(tenant)
            entry = None if cached is None else cached.get(constraint)
            if entry is not None:
                self.hits += 1
                self._cache.move_to_end(tenant)
                cached.move_to_end(constraint)  # type: ignore[union-attr]
        if entry is None:
            entry = self._measure(constraint)
            with self._lock:
                self.misses += 1
                cached = self._cache.setdefault(tenant, OrderedDict())
                entry = cached.setdefault(constraint, entry)  # a concurrent miss may have stored it first
                self._cache.move_to_end(tenant)
                while len(cached) > MAX_CACHED_PER_TENANT:
                    cached.popitem(last=False)
                while len(self._cache) > MAX_CACHED_TENANTS:
                    self._cache.popitem(last=False)
        self._check_fits(constraint, entry, max_tokens)
        return entry

    def _measure(self, constraint: OutputConstraint) -> _Entry:
        text = constraint.schema
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise GrammarError(f"{_label(constraint, None)} has {len(text)} characters; at most "
                               f"{MAX_CONSTRAINT_CHARS} are allowed", kind="too_large")
        depth = json_depth(text)
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{_label(constraint, None)} is nested {depth} levels deep; at most "
                               f"{MAX_SCHEMA_DEPTH} are allowed", kind="too_large")
        try:
            body = self._xgr.Grammar.from_json_schema(text, any_whitespace=False)
        except Exception as exc:  # noqa: BLE001 - xgrammar's converter raises RuntimeError naming the construct
            tool = _failing_tool(self._xgr, constraint)
            raise GrammarError(f"{_label(constraint, tool)} cannot be used as a grammar: {_clean(exc)}",
                               kind="unsupported", tool=tool) from None
        literal = len(constraint.prefix.encode()) + len(constraint.suffix.encode())
        witness_bytes = max(0, min(1 << 20, 8 * MAX_CONSTRAINT_CHARS) - literal)
        try:
            body_bounds = measure(body.serialize_json(), expand_regex=self._expand_regex,
                                  witness_bytes=witness_bytes, max_nodes=MAX_GRAMMAR_RULES)
        except NoFiniteOutput as exc:
            raise _no_finite_output(constraint, exc) from None
        except UnsupportedGrammar as exc:
            raise GrammarError(f"{_label(constraint, None)} cannot be used as a grammar: {exc}",
                               kind="unsupported") from None
        shortest = None if body_bounds.shortest_text is None else \
            constraint.prefix + body_bounds.shortest_text + constraint.suffix
        bounds = GrammarBounds(body_bounds.shortest_bytes + literal, shortest, body_bounds.longest_part,
                               body_bounds.num_rules)
        if shortest is None:  # longer than any output: a lower bound is enough to refuse it
            tokens = math.ceil(bounds.shortest_bytes / self.max_token_bytes)
        else:
            tokens = len(self._tokenizer.encode(shortest, add_special_tokens=False))
        return _Entry(bounds, tokens)

    def _check_fits(self, constraint: OutputConstraint, entry: _Entry, max_tokens: int) -> None:
        bounds = entry.bounds
        if entry.shortest_tokens > max_tokens:
            example = "" if bounds.shortest_text is None else f" ({_preview(bounds.shortest_text)})"
            raise GrammarError(f"the shortest output {_label(constraint, None)} allows is {entry.shortest_tokens} "
                               f"tokens{example}, more than max_tokens={max_tokens}: raise max_tokens or "
                               "shorten what the schema requires", kind="does_not_fit")
        capacity = max_tokens * self.max_token_bytes
        if bounds.longest_part_bytes > capacity:
            rule, size = [(r, n) for r, n in bounds.longest_part if n > capacity][-1]  # the innermost too long
            tool, where = _locate(constraint, rule)
            raise GrammarError(f"{_label(constraint, tool)}: a value at {where} needs at least {size} characters, "
                               f"more than max_tokens={max_tokens} tokens can hold (at most {capacity}): raise "
                               "max_tokens or lower the schema's minimum sizes there", kind="does_not_fit", tool=tool)

    def _grammar(self, constraint: OutputConstraint) -> Any:
        # Compact JSON with json.dumps' separators: no free whitespace for a model to loop in, and the
        # same text a reply sent back in a later request renders to (grpc_api/tool_calls.py).
        xgr = self._xgr
        body = xgr.Grammar.from_json_schema(constraint.schema, any_whitespace=False)
        parts = [xgr.Grammar.from_ebnf(f"root ::= {_literal(constraint.prefix)}")] if constraint.prefix else []
        parts.append(body)
        if constraint.suffix:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {_literal(constraint.suffix)}"))
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else body

    def _expand_regex(self, pattern: str) -> str:
        return str(self._xgr.Grammar.from_regex(pattern).serialize_json())


def json_depth(text: str) -> int:
    """How deeply ``text``'s JSON nests (brackets outside strings), without parsing it: a cheap bound
    checked before any recursive parser sees the text."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def _label(constraint: OutputConstraint, tool: str | None) -> str:
    """What a message calls the constraint's schema."""
    if tool is not None:
        return f"the parameters schema of tool {tool!r}"
    if constraint.name == "tool_calls":
        return "the tool-call schema"
    if constraint.name == "json_object":
        return "the json_object response format"
    return f"the {constraint.name} schema"


_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")
_SOURCE_PATH = re.compile(r"(?:/[\w.+-]+)+\.(?:cc|h|cpp|hpp|py):\d+:?\s*")


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its timestamp, source path and echoed input."""
    text = _XGRAMMAR_PREFIX.sub("", str(exc))
    text = text.replace("Check failed: (error.empty()) is false: ", "")
    text = text.split(" The JSON string is:")[0]
    text = _SOURCE_PATH.sub("", text)
    text = " ".join(text.split())
    return text[:300] if text else type(exc).__name__


def _tools(constraint: OutputConstraint) -> list[tuple[str, Any]]:
    """(name, call schema) of each tool of a ``tool_calls`` constraint (grpc_api.tool_calls builds one
    call object per tool, ``{"properties": {"name": {"const": ...}, "arguments": ...}}``, under
    ``anyOf`` when there are several)."""
    if constraint.name != "tool_calls":
        return []
    try:
        schema = json.loads(constraint.schema)
        calls = schema.get("anyOf", [schema])
        return [(str(c["properties"]["name"]["const"]), c) for c in calls]
    except (ValueError, KeyError, TypeError):
        return []


def _failing_tool(xgr: Any, constraint: OutputConstraint) -> str | None:
    """The first tool whose call schema xgrammar cannot convert (error path only)."""
    for name, call in _tools(constraint):
        try:
            xgr.Grammar.from_json_schema(json.dumps(call), any_whitespace=False)
        except Exception:  # noqa: BLE001 - this is the one
            return name
    return None


def _no_finite_output(constraint: OutputConstraint, exc: NoFiniteOutput) -> GrammarError:
    located = [_locate(constraint, rule) for rule in exc.rules]
    tool = next((t for t, _ in located if t is not None), None)
    chain = _dedupe_where(where for _, where in located)
    if exc.cause == "cycle":
        needs = ", which needs ".join(f"one at {where}" for where in chain[1:]) if len(chain) > 1 else \
            f"another one at {chain[0]}"
        return GrammarError(f"{_label(constraint, tool)} has no finite value: a value at {chain[0]} needs {needs}, "
                            "without end (a $ref cycle through required properties, items or allOf; give it a "
                            "way out, e.g. an optional property or an anyOf branch)", kind="no_finite_output",
                            tool=tool)
    return GrammarError(f"{_label(constraint, tool)} has no valid value: {chain[-1]} matches no text (a pattern or "
                        "character set that allows nothing)", kind="no_finite_output", tool=tool)


def _dedupe_where(items: Any) -> list[str]:
    out: list[str] = []
    for item in items:
        if not out or out[-1] != item:
            out.append(item)
    return out


_PREFIXES = (("defs_", "$defs"), ("definitions_", "definitions"))


def _locate(constraint: OutputConstraint, rule: str) -> tuple[str | None, str]:
    """Where in the schema an xgrammar rule comes from, as (tool, JSON pointer in the tool's parameters
    or the schema). xgrammar's converter names rules ``root``, ``defs_<name>``, then ``_prop_<i>``
    (the i-th property), ``_case_<i>`` (anyOf/oneOf), ``_item_<i>`` (prefixItems), ``_additional``
    (items); other suffixes are its helpers, where reading stops."""
    try:
        schema = json.loads(constraint.schema)
    except ValueError:
        return None, repr(rule)
    pointer = _pointer(rule.split("/")[0], schema)
    if pointer is None:
        return None, f"its grammar rule {rule!r}"
    for i, (name, _) in enumerate(_tools(constraint)):
        base = f"#/anyOf/{i}/properties/arguments" if "anyOf" in schema else "#/properties/arguments"
        if pointer == base:
            return name, "its parameters' root"
        if pointer.startswith(base + "/"):
            return name, f'"#{pointer[len(base):]}" in its parameters'
    if constraint.name == "tool_calls":
        return None, "the tool-call object"
    return None, f'"{pointer}"'


def _pointer(rule: str, schema: Any) -> str | None:
    node, path, rest = schema, "#", None
    if rule == "root" or rule.startswith("root_"):
        rest = rule[len("root"):]
    else:
        for prefix, key in _PREFIXES:
            defs = schema.get(key) if isinstance(schema, dict) else None
            if not rule.startswith(prefix) or not isinstance(defs, dict):
                continue
            names = [n for n in defs if rule == prefix + n or rule.startswith(prefix + n + "_")]
            if names:
                name = max(names, key=len)
                node, path, rest = defs[name], f"#/{key}/{_escape(name)}", rule[len(prefix + name):]
                break
    if rest is None:
        return None
    tokens = rest.split("_")[1:]
    i = 0
    try:
        while i < len(tokens):
            word, index = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
            if word == "prop" and index.isdigit():
                key = list(node["properties"])[int(index)]
                node, path = node["properties"][key], f"{path}/properties/{_escape(key)}"
            elif word == "case" and index.isdigit():
                key = "anyOf" if "anyOf" in node else "oneOf"
                node, path = node[key][int(index)], f"{path}/{key}/{index}"
            elif word == "item" and index.isdigit():
                node, path = node["prefixItems"][int(index)], f"{path}/prefixItems/{index}"
            elif word == "additional" and index != "properties":
                node, path = node["items"], f"{path}/items"
                i -= 1
            else:
                break
            i += 2
    except (KeyError, IndexError, TypeError, ValueError):
        pass
    return path


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _preview(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


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

        The text is bounded: the compiler refused grammars with a part that has no finite output or
        needs more than the request's ``max_tokens`` (reprise/engine/grammar_bounds.py), and a forced
        string is a prefix of every way to complete the parts open at the committed tokens. At most
        ``MAX_FORCED_CHARS_PER_TOKEN`` characters per wanted token are tokenized."""
        if limit <= 0 or self.matcher.is_terminated():
            return []
        if self._tokenizer is None:
            # xgrammar 0.2.8 (what vLLM 0.32.0 pins) has no token-level jump forward: none without a tokenizer.
            tokens = getattr(self.matcher, "find_jump_forward_tokens", None)
            return list(tokens())[:limit] if tokens is not None else []
        text = self.matcher.find_jump_forward_string()[: limit * MAX_FORCED_CHARS_PER_TOKEN]
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
