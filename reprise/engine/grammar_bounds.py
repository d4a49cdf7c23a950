"""What a grammar's outputs cost at least, read from xgrammar's grammar before any decoding.

xgrammar answers "which tokens may come next"; it does not say whether a grammar has any finite output,
and its jump-forward (``find_jump_forward_string``) follows a forced path for as long as it is forced: a
schema that recurses through a required field (``{"properties": {"a": {"$ref": "#"}}, "required":
["a"]}``) or a pattern that ends in a character set matching nothing forces an endless string, and a
grammar that allows no token at all leaves the engine nothing to commit. So every grammar is measured
here first, from its rules (``Grammar.serialize_json``: rules over a CSR array of expressions):

* each rule's **shortest derivation**, in bytes, by Knuth's generalisation of Dijkstra's algorithm to
  grammars (D. E. Knuth, "A generalization of Dijkstra's algorithm", IPL 6(1), 1977): an alternative's
  length is its literals plus its rules' lengths (times a repetition's minimum count); a rule is settled
  at the smallest length any of its alternatives reaches, once the rules that alternative needs are
  settled. Rules never settled have no finite derivation.
* **reachability** from the root. Every alternative of every reachable rule must be *live* (finite
  derivations for everything it refers to, no character set that matches nothing): a dead one is a
  path the matcher can enter and never leave. ``measure`` raises ``NoFiniteOutput`` naming the cause.
* ``longest_part``: the most bytes any one reachable alternative needs, and where that comes from. A
  forced string never exceeds what completing the alternatives open on the parser's stack needs, so
  with every part bounded the jump-forward string is bounded by the nesting depth times this.
* a **shortest complete output** (``shortest_text``), which the caller tokenizes to bound the tokens
  every output needs.

Pure Python over the serialized grammar (version ``SERIALIZATION_VERSION``); the cost is linear in the
grammar's size (times a log for the queue). xgrammar is reached only through the ``expand_regex``
callable a caller passes in (a regex rule's pattern, expanded to a grammar by ``Grammar.from_regex``).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SERIALIZATION_VERSION = "v16"  # xgrammar 0.2.x's Grammar.serialize_json format, as read below

# xgrammar's GrammarExprType (cpp/grammar_impl.h): each expression is [type, data_len, data...].
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)
_REGEX = 12
_MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # not encodable in UTF-8
_JSON_STRING_EXCLUDED = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # unescaped control chars, '"', '\'


class UnsupportedGrammar(ValueError):
    """The grammar uses an expression this module does not measure (none a JSON schema produces)."""


class NoFiniteOutput(ValueError):
    """A reachable part of the grammar has no finite output. ``rules``: the rule names that show it (a
    cycle that never ends, or the one rule whose alternatives match nothing); ``cause``: ``cycle`` or
    ``matches_nothing``."""

    def __init__(self, rules: tuple[str, ...], cause: str) -> None:
        super().__init__(f"no finite output ({cause}: {' -> '.join(rules)})")
        self.rules = rules
        self.cause = cause


@dataclass(frozen=True, slots=True)
class GrammarBounds:
    """What every output of a grammar needs, in bytes of UTF-8 text: ``shortest_bytes`` (a complete
    output at least; ``shortest_text`` one such output, None when it is longer than the caller's
    ``witness_bytes``), and ``longest_part`` (the most any one reachable alternative needs, as a path of
    (rule, bytes) from that alternative's rule down through the largest rule each step needs, so a
    caller can name the innermost part that is too long)."""

    shortest_bytes: int
    shortest_text: str | None
    longest_part: tuple[tuple[str, int], ...]
    num_rules: int

    @property
    def longest_part_bytes(self) -> int:
        return self.longest_part[0][1]


@dataclass(slots=True)
class _Alt:
    """One alternative of a node: a sequence of pieces. ``fixed``: bytes of its literals; ``dead``: a
    piece matches nothing; ``needs``: node -> how many times the shortest derivation repeats it;
    ``refs``: every node it may enter (``needs`` plus repetitions that may be skipped)."""

    node: int
    pieces: list[tuple[int, bytes | int, int]] = field(default_factory=list)  # (kind, literal|node, count)
    fixed: int = 0
    dead: bool = False
    needs: dict[int, int] = field(default_factory=dict)
    refs: set[int] = field(default_factory=set)

    def add_literal(self, text: bytes) -> None:
        self.pieces.append((0, text, 1))
        self.fixed += len(text)

    def add_node(self, node: int, count: int) -> None:
        self.refs.add(node)
        if count > 0:
            self.pieces.append((1, node, count))
            self.needs[node] = self.needs.get(node, 0) + count


class _Reader:
    """Reads serialized grammars into nodes (one per rule, one per nested choice, a sub-grammar per
    regex rule) of alternatives."""

    def __init__(self, expand_regex: Callable[[str], str] | None, max_nodes: int) -> None:
        self.expand_regex = expand_regex
        self.max_nodes = max_nodes
        self.names: list[str] = []
        self.alts: list[list[_Alt]] = []

    def read(self, grammar_json: str, prefix: str = "", json_string: bool = False) -> int:
        """Adds the grammar's rules as nodes; returns its root node."""
        data = json.loads(grammar_json)
        version = data.get("__VERSION__")
        if version != SERIALIZATION_VERSION:
            raise UnsupportedGrammar(f"xgrammar serializes grammars as {version!r}; this reader knows "
                                     f"{SERIALIZATION_VERSION!r} (reprise/engine/grammar_bounds.py)")
        exprs, indptr = data["grammar_expr_data"], data["grammar_expr_indptr"]
        rules = data["rules"]
        base = len(self.names)
        self._grow(len(rules))
        for rule in rules:
            self.names.append(prefix + str(rule[0]))
            self.alts.append([])
        grammar = _Source(exprs, indptr, base, json_string)
        for i, rule in enumerate(rules):
            self.alts[base + i] = self._alternatives(grammar, int(rule[1]), base + i)
        return base + int(data["root_rule_id"])

    def _grow(self, n: int) -> None:
        if len(self.names) + n > self.max_nodes:
            raise UnsupportedGrammar(f"the grammar has more than {self.max_nodes} rules")

    def _alternatives(self, g: _Source, expr_id: int, node: int) -> list[_Alt]:
        kind, args = g.expr(expr_id)
        if kind == _REGEX:
            return [self._regex(g, args, node)]
        children = args if kind == _CHOICES else [expr_id]
        out = []
        for child in children:
            alt = _Alt(node)
            self._sequence(g, child, alt)
            out.append(alt)
        return out

    def _sequence(self, g: _Source, expr_id: int, alt: _Alt) -> None:
        kind, args = g.expr(expr_id)
        if kind == _BYTES:
            text = bytes(args)
            if g.json_string and any(_excluded_in_json_string(b) for b in text):
                alt.dead = True
            alt.add_literal(text)
        elif kind == _CLASS:
            char = _first_char(bool(args[0]), args[1:], g.json_string)
            if char is None:
                alt.dead = True
            else:
                alt.add_literal(char)
        elif kind in (_CLASS_STAR, _EMPTY):  # a starred class may match nothing: it adds no bytes
            pass
        elif kind == _RULE:
            alt.add_node(g.base + args[0], 1)
        elif kind == _REPEAT:
            alt.add_node(g.base + args[0], max(0, args[1]))
        elif kind == _SEQUENCE:
            for child in args:
                self._sequence(g, child, alt)
        elif kind == _CHOICES:  # a nested choice becomes a node of its own
            self._grow(1)
            node = len(self.names)
            self.names.append(self.names[alt.node])
            self.alts.append([])
            self.alts[node] = self._alternatives(g, expr_id, node)
            alt.add_node(node, 1)
        elif kind == _REGEX:
            self._grow(1)
            node = len(self.names)
            self.names.append(self.names[alt.node])
            self.alts.append([])
            self.alts[node] = [self._regex(g, args, node)]
            alt.add_node(node, 1)
        else:
            raise UnsupportedGrammar(f"grammar expression type {kind} (rule {self.names[alt.node]!r})")

    def _regex(self, g: _Source, args: list[int], node: int) -> _Alt:
        """A regex rule: its pattern expanded into a grammar of its own, whose root this node refers to."""
        if self.expand_regex is None:
            raise UnsupportedGrammar(f"rule {self.names[node]!r} is a regular expression; no expander was given")
        pattern = bytes(args[1:]).decode("utf-8", errors="replace")
        try:
            expanded = self.expand_regex(pattern)
        except Exception as exc:  # noqa: BLE001 - the pattern is the caller's: say which one failed
            raise UnsupportedGrammar(f"the pattern {pattern!r} cannot be read: {exc}") from None
        root = self.read(expanded, prefix=self.names[node] + "/", json_string=bool(args[0]))
        alt = _Alt(node)
        alt.add_node(root, 1)
        return alt


@dataclass(frozen=True, slots=True)
class _Source:
    """One serialized grammar's expressions; ``base``: the node id of its rule 0."""

    data: list[int]
    indptr: list[int]
    base: int
    json_string: bool

    def expr(self, expr_id: int) -> tuple[int, list[int]]:
        start = self.indptr[expr_id]
        kind, length = self.data[start], self.data[start + 1]
        return kind, self.data[start + 2 : start + 2 + length]


def measure(grammar_json: str, *, expand_regex: Callable[[str], str] | None = None,
            witness_bytes: int = 1 << 20, max_nodes: int = 200_000) -> GrammarBounds:
    """The bounds of a serialized xgrammar grammar (``Grammar.serialize_json()``). Raises
    ``NoFiniteOutput`` when a reachable part has no finite output, ``UnsupportedGrammar`` for a grammar
    this module cannot read (or more than ``max_nodes`` rules)."""
    reader = _Reader(expand_regex, max_nodes)
    root = reader.read(grammar_json)
    alts = reader.alts
    length, best = _shortest(alts)
    reachable = _reachable(alts, root)
    for node in reachable:
        if length[node] is None or any(alt.dead for alt in alts[node]):
            raise NoFiniteOutput(*_cause(reader, length, node))
    longest, longest_alt = -1, alts[root][0]
    for node in reachable:
        for alt in alts[node]:
            value = _value(alt, length)
            assert value is not None  # every reachable alternative is live (checked above)
            if value > longest:
                longest, longest_alt = value, alt
    part = [(reader.names[longest_alt.node], longest)]
    alt_at: _Alt | None = longest_alt
    while alt_at is not None and alt_at.needs:  # down through the largest rule needed (acyclic: Knuth's order)
        child = max(alt_at.needs, key=lambda n: length[n] or 0)
        part.append((reader.names[child], length[child] or 0))
        alt_at = best[child]
    shortest = length[root]
    assert shortest is not None
    text = _witness(alts, best, root) if shortest <= witness_bytes else None
    return GrammarBounds(shortest, text, tuple(part), len(alts))


def _value(alt: _Alt, length: list[int | None]) -> int | None:
    if alt.dead:
        return None
    total = alt.fixed
    for node, count in alt.needs.items():
        n = length[node]
        if n is None:
            return None
        total += count * n
    return total


def _shortest(alts: list[list[_Alt]]) -> tuple[list[int | None], list[_Alt | None]]:
    """Each node's shortest derivation in bytes (None: no finite one) and the alternative that gives it
    (Knuth 1977: settle nodes in order of length; an alternative is ready once all it needs is settled)."""
    num = len(alts)
    length: list[int | None] = [None] * num
    best: list[_Alt | None] = [None] * num
    waiting: list[list[_Alt]] = [[] for _ in range(num)]  # node -> alternatives that need it
    pending: dict[int, int] = {}  # id(alt) -> nodes it needs that are not settled
    queue: list[tuple[int, int, int]] = []  # (length, node, tie-break)
    ready: list[_Alt] = []
    for node_alts in alts:
        for alt in node_alts:
            if alt.dead:
                continue
            pending[id(alt)] = len(alt.needs)
            for need in alt.needs:
                waiting[need].append(alt)
            if not alt.needs:
                ready.append(alt)
    settled_alt: dict[int, _Alt] = {}
    for alt in ready:
        _push(queue, alt, length, settled_alt)
    while queue:
        value, node, key = heapq.heappop(queue)
        if length[node] is not None:
            continue
        length[node] = value
        best[node] = settled_alt[key]
        for alt in waiting[node]:
            pending[id(alt)] -= 1
            if pending[id(alt)] == 0:
                _push(queue, alt, length, settled_alt)
    return length, best


def _push(queue: list[tuple[int, int, int]], alt: _Alt, length: list[int | None], by_key: dict[int, _Alt]) -> None:
    value = _value(alt, length)
    assert value is not None
    key = len(by_key)
    by_key[key] = alt
    heapq.heappush(queue, (value, alt.node, key))


def _reachable(alts: list[list[_Alt]], root: int) -> list[int]:
    seen = {root}
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        for alt in alts[node]:
            for ref in alt.refs:
                if ref not in seen:
                    seen.add(ref)
                    stack.append(ref)
    return order


def _cause(reader: _Reader, length: list[int | None], start: int) -> tuple[tuple[str, ...], str]:
    """Why ``start`` (reachable) has no finite output or a dead alternative: a chain of rules each of
    which needs the next, ending in a cycle, or a rule whose every way on matches nothing."""
    path = [start]
    seen = {start: 0}
    node = start
    while True:
        alts = reader.alts[node]
        if any(alt.dead for alt in alts) or not alts:
            return tuple(reader.names[n] for n in path), "matches_nothing"
        # Every alternative needs an unsettled node (else this one would be settled): follow the first.
        nxt = next((n for alt in alts for n in alt.refs if length[n] is None), None)
        if nxt is None:  # only a skippable repetition of a settled node: cannot happen for an unsettled node
            return tuple(reader.names[n] for n in path), "matches_nothing"
        if nxt in seen:
            cycle = path[seen[nxt]:] + [nxt]
            return tuple(_dedupe(reader.names[n] for n in cycle)), "cycle"
        seen[nxt] = len(path)
        path.append(nxt)
        node = nxt


def _dedupe(names: Iterable[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        if not out or out[-1] != name:
            out.append(name)
    return out


def _witness(alts: list[list[_Alt]], best: list[_Alt | None], root: int) -> str:
    """A shortest complete output: each node expanded by its best alternative (iteratively)."""
    out = bytearray()
    stack: list[tuple[int, bytes | int, int]] = [(1, root, 1)]
    while stack:
        kind, value, count = stack.pop()
        if kind == 0:
            assert isinstance(value, bytes)
            out += value
            continue
        assert isinstance(value, int)
        alt = best[value]
        assert alt is not None
        for _ in range(count):
            stack.extend(reversed(alt.pieces))
    return out.decode("utf-8", errors="replace")


def _first_char(negated: bool, bounds: list[int], json_string: bool) -> bytes | None:
    """The shortest (in UTF-8), preferably printable, character a class allows; None when it allows
    none. ``bounds``: [lo0, hi0, lo1, hi1, ...] codepoints."""
    ranges = sorted((bounds[i], bounds[i + 1]) for i in range(0, len(bounds) - 1, 2))
    allowed = _complement(ranges) if negated else _merge(ranges)
    excluded = [_SURROGATES] + (list(_JSON_STRING_EXCLUDED) if json_string else [])
    allowed = _subtract(allowed, _merge(excluded))
    for lo, hi in ((0x20, 0x7E), (0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, _MAX_CODEPOINT)):
        for a, b in allowed:
            if a <= hi and b >= lo:
                return chr(max(a, lo)).encode("utf-8")
    return None


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in _merge(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = max(at, hi + 1)
    if at <= _MAX_CODEPOINT:
        out.append((at, _MAX_CODEPOINT))
    return out


def _subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    keep = _complement(minus)
    out = []
    for a, b in ranges:
        for c, d in keep:
            lo, hi = max(a, c), min(b, d)
            if lo <= hi:
                out.append((lo, hi))
    return out


def _excluded_in_json_string(byte: int) -> bool:
    return any(lo <= byte <= hi for lo, hi in _JSON_STRING_EXCLUDED)
