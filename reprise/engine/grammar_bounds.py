"""What a grammar's outputs cost at least, and how long a forced string can get, read from xgrammar's
grammar before any decoding.

xgrammar answers "which tokens may come next"; it does not say whether a grammar has any finite output,
and its jump-forward (``find_jump_forward_string``) follows a forced path for as long as it is forced: a
schema that recurses through a required field (``{"properties": {"a": {"$ref": "#"}}, "required":
["a"]}``) or a pattern ending in a character set that matches nothing forces an endless string, and a
grammar that allows no token at all leaves the engine nothing to commit. So every grammar is measured
here first, from its rules (``Grammar.serialize_json``: rules over a CSR array of expressions):

* each rule's **shortest derivation**, in bytes, by Knuth's generalisation of Dijkstra's algorithm to
  grammars (D. E. Knuth, "A generalization of Dijkstra's algorithm", IPL 6(1), 1977): an alternative's
  length is its literals plus its rules' lengths (times a repetition's minimum count); a rule is settled
  at the smallest length any of its alternatives reaches once the rules that alternative needs are
  settled. Rules never settled have no finite derivation.
* **reachability** from the root: every alternative of every reachable rule must be *live* (finite
  derivations for all it refers to, no character set matching nothing); a dead one is a path the
  matcher can enter and never leave. ``measure`` raises ``NoFiniteOutput`` naming the cause.
* ``longest_part``: the most bytes any one reachable alternative needs (and where that comes from).
* ``forced_levels``: how many alternatives one forced string can run on into after the one it starts
  in. Within one alternative a forced string is at most what completing it needs (``longest_part``);
  once the rule finishes it goes on into the enclosing alternative, through all of what follows there
  when that is forced too (and then on again), or through a forced beginning of it, where it ends
  (``[-`` of ``"[" ("0" | "-1000") (", " item){1,}`` forces ``1000, ""``: two parts). An
  over-approximation of "forced" (first-byte sets: a point where two different bytes may come next
  ends any forced string) gives a graph of such continuations; without a cycle every forced string is
  at most ``(forced_levels + 1) * longest_part`` bytes, with one (``forced_levels`` None: a constant
  required after a recursive field) it can grow with the output's nesting depth, and the caller turns
  jump-forward off.
* a **shortest complete output** (``shortest_text``), which the caller tokenizes to bound the tokens
  every output needs.

Pure Python over the serialized grammar (version ``SERIALIZATION_VERSION``); linear in the grammar's
size (times a log for the queue). xgrammar is reached only through the ``expand_regex`` callable a caller
passes in (a regex rule's pattern expanded into a grammar of its own by ``Grammar.from_regex``).
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SERIALIZATION_VERSION = "v16"  # xgrammar 0.2.x's Grammar.serialize_json format, as read below

# xgrammar's GrammarExprType (cpp/grammar_impl.h): each expression is [type, data_len, data...].
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)
_REGEX = 12
_MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # not encodable in UTF-8
_JSON_STRING_EXCLUDED = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # unescaped control chars, '"', '\'
_UTF8_BANDS = ((0, 0x7F, 0, 0x00), (0x80, 0x7FF, 6, 0xC0), (0x800, 0xFFFF, 12, 0xE0), (0x10000, _MAX_CODEPOINT, 18, 0xF0))
_LIT, _ONE_OF, _STAR, _REF = range(4)  # element kinds


class UnsupportedGrammar(ValueError):
    """The grammar uses an expression this module does not measure (none a JSON schema produces)."""


class NoFiniteOutput(ValueError):
    """A reachable part of the grammar has no finite output. ``rules``: the rule names that show it (a
    cycle that never ends, or a chain down to the rule whose alternative matches nothing); ``cause``:
    ``cycle`` or ``matches_nothing``."""

    def __init__(self, rules: tuple[str, ...], cause: str) -> None:
        super().__init__(f"no finite output ({cause}: {' -> '.join(rules)})")
        self.rules = rules
        self.cause = cause


@dataclass(frozen=True, slots=True)
class GrammarBounds:
    """What every output of a grammar needs, in bytes of UTF-8 text: ``shortest_bytes`` (a complete
    output at least; ``shortest_text`` one such output, None when longer than the caller's
    ``witness_bytes``); ``longest_part`` (the most any one reachable alternative needs, as a path of
    (rule, bytes) from that alternative's rule down through the largest rule each step needs, so a
    caller can name the innermost part that is too long); ``forced_levels`` (see the module docstring;
    None when forced strings can grow with nesting)."""

    shortest_bytes: int
    shortest_text: str | None
    longest_part: tuple[tuple[str, int], ...]
    forced_levels: int | None
    num_rules: int

    @property
    def longest_part_bytes(self) -> int:
        return self.longest_part[0][1]

    @property
    def max_forced_bytes(self) -> int | None:
        """The longest string jump-forward can force (None: no bound independent of the output)."""
        return None if self.forced_levels is None else (self.forced_levels + 1) * self.longest_part_bytes


@dataclass(frozen=True, slots=True)
class _Elem:
    """One element of an alternative: a literal (``first``: its first byte), a character class
    (``one_of``; ``single``: it allows one codepoint), a starred class, or a rule repeated ``lo`` to
    ``hi`` times (-1: unbounded; 1 to 1 for a plain reference)."""

    kind: int
    first: frozenset[int] = frozenset()
    single: bool = True
    node: int = -1
    lo: int = 1
    hi: int = 1


@dataclass(slots=True)
class _Alt:
    """One alternative of a node. ``pieces``: the shortest derivation's literals and rules (with their
    repeat count); ``fixed``: its literal bytes; ``dead``: an element matches nothing; ``needs``: node ->
    times the shortest derivation uses it; ``refs``: every node it may enter; ``elems``: its elements."""

    node: int
    pieces: list[tuple[int, bytes | int, int]] = field(default_factory=list)  # (kind, literal|node, count)
    fixed: int = 0
    dead: bool = False
    needs: dict[int, int] = field(default_factory=dict)
    refs: set[int] = field(default_factory=set)
    elems: list[_Elem] = field(default_factory=list)

    def add_literal(self, text: bytes, elem: _Elem) -> None:
        self.pieces.append((0, text, 1))
        self.fixed += len(text)
        self.elems.append(elem)

    def add_node(self, node: int, lo: int, hi: int) -> None:
        self.refs.add(node)
        self.elems.append(_Elem(_REF, node=node, lo=lo, hi=hi))
        if lo > 0:
            self.pieces.append((1, node, lo))
            self.needs[node] = self.needs.get(node, 0) + lo


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
        rules = data["rules"]
        base = self._new_nodes([prefix + str(rule[0]) for rule in rules])
        grammar = _Source(data["grammar_expr_data"], data["grammar_expr_indptr"], base, json_string)
        for i, rule in enumerate(rules):
            self.alts[base + i] = self._alternatives(grammar, int(rule[1]), base + i)
        return base + int(data["root_rule_id"])

    def _new_nodes(self, names: list[str]) -> int:
        if len(self.names) + len(names) > self.max_nodes:
            raise UnsupportedGrammar(f"the grammar has more than {self.max_nodes} rules")
        base = len(self.names)
        self.names.extend(names)
        self.alts.extend([] for _ in names)
        return base

    def _alternatives(self, g: _Source, expr_id: int, node: int) -> list[_Alt]:
        kind, args = g.expr(expr_id)
        if kind == _REGEX:
            return [self._regex(g, args, node)]
        out = []
        for child in args if kind == _CHOICES else [expr_id]:
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
            if text:
                alt.add_literal(text, _Elem(_LIT, frozenset((text[0],))))
        elif kind in (_CLASS, _CLASS_STAR):
            witness, single, leads = _class(bool(args[0]), args[1:], g.json_string)
            if kind == _CLASS_STAR:  # may match nothing: it adds no bytes to the shortest derivation
                alt.elems.append(_Elem(_STAR, leads, single))
            elif witness is None:
                alt.dead = True
            else:
                alt.add_literal(witness, _Elem(_ONE_OF, leads, single))
        elif kind == _EMPTY:
            pass
        elif kind == _RULE:
            alt.add_node(g.base + args[0], 1, 1)
        elif kind == _REPEAT:
            alt.add_node(g.base + args[0], max(0, args[1]), args[2])
        elif kind == _SEQUENCE:
            for child in args:
                self._sequence(g, child, alt)
        elif kind in (_CHOICES, _REGEX):  # a nested choice (or pattern) becomes a node of its own
            node = self._new_nodes([self.names[alt.node]])
            self.alts[node] = self._alternatives(g, expr_id, node)
            alt.add_node(node, 1, 1)
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
        alt.add_node(root, 1, 1)
        return alt


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
    text = _witness(best, root) if shortest <= witness_bytes else None
    return GrammarBounds(shortest, text, tuple(part), _forced_levels(alts, reachable), len(alts))


# ---- shortest derivations --------------------------------------------------------------------------


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
    queue: list[tuple[int, int, int]] = []  # (length, node, key of the alternative)
    by_key: list[_Alt] = []
    for node_alts in alts:
        for alt in node_alts:
            if alt.dead:
                continue
            pending[id(alt)] = len(alt.needs)
            for need in alt.needs:
                waiting[need].append(alt)
            if not alt.needs:
                _push(queue, alt, length, by_key)
    while queue:
        value, node, key = heapq.heappop(queue)
        if length[node] is not None:
            continue
        length[node] = value
        best[node] = by_key[key]
        for alt in waiting[node]:
            pending[id(alt)] -= 1
            if pending[id(alt)] == 0:
                _push(queue, alt, length, by_key)
    return length, best


def _push(queue: list[tuple[int, int, int]], alt: _Alt, length: list[int | None], by_key: list[_Alt]) -> None:
    value = _value(alt, length)
    assert value is not None
    heapq.heappush(queue, (value, alt.node, len(by_key)))
    by_key.append(alt)


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
    which needs the next, ending in a cycle, or at a rule with an alternative that matches nothing."""
    path = [start]
    seen = {start: 0}
    node = start
    while True:
        alts = reader.alts[node]
        nxt = next((n for alt in alts for n in alt.refs if length[n] is None), None)
        if nxt is None or any(alt.dead for alt in alts):
            return tuple(_dedupe(reader.names[n] for n in path)), "matches_nothing"
        if nxt in seen:
            return tuple(_dedupe(reader.names[n] for n in path[seen[nxt]:] + [nxt])), "cycle"
        seen[nxt] = len(path)
        path.append(nxt)
        node = nxt


def _dedupe(names: Iterable[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        if not out or out[-1] != name:
            out.append(name)
    return out


def _witness(best: list[_Alt | None], root: int) -> str:
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


# ---- forced strings --------------------------------------------------------------------------------


def _forced_levels(alts: list[list[_Alt]], reachable: list[int]) -> int | None:
    """How many alternatives one forced string can run on into while adding text, None when unbounded.

    The graph: a rule R finished inside an alternative of N runs on into N when the rest of that
    alternative may be forced (``into[R]`` holds (N, the rest has elements)). A cycle of edges whose rests
    are empty (right recursion) adds no text; a cycle through a rest with text makes forced strings grow
    with nesting (None). Otherwise: the longest path, counting edges with text, over the condensation.
    A rest that may be forced only at its start (``ends_in[R]``: a required item, then a choice) is one
    more part, and the last: the forced string ends inside it, so it is a step at the end of a path,
    never an edge of a cycle."""
    nullable, first = _first_bytes(alts)
    forced = _forcible(alts, nullable, first)
    into: dict[int, list[tuple[int, bool]]] = {n: [] for n in reachable}
    ends_in: set[int] = set()
    for node in reachable:
        for alt in alts[node]:
            rest_ok, rest_null, rest_first = True, True, frozenset[int]()
            for i in range(len(alt.elems) - 1, -1, -1):
                elem = alt.elems[i]
                if elem.kind == _REF:
                    more = elem.hi == -1 or elem.hi > elem.lo  # another repetition may follow
                    if more and _branches(first[elem.node], rest_null, rest_first):
                        pass  # the rule itself or the rest: a choice, nothing is forced after R here
                    elif rest_ok:
                        into[elem.node].append((node, i + 1 < len(alt.elems)))
                    elif not _branches(frozenset(), rest_null, rest_first):  # its first byte may be forced
                        ends_in.add(elem.node)
                rest_ok = rest_ok and _elem_forcible(elem, forced, nullable, first, rest_null, rest_first)
                rest_null, rest_first = _prepend(elem, nullable, first, rest_null, rest_first)
    components = _components(into)  # sinks first
    component = {n: c for c, members in enumerate(components) for n in members}
    levels = [0] * len(components)
    for c, members in enumerate(components):
        for node in members:
            if node in ends_in:
                levels[c] = max(levels[c], 1)
            for target, text in into[node]:
                if component[target] == c:
                    if text:
                        return None
                    continue
                levels[c] = max(levels[c], levels[component[target]] + int(text))
    return max(levels, default=0)


def _components(edges: dict[int, list[tuple[int, bool]]]) -> list[list[int]]:
    """Strongly connected components (Tarjan, iterative), each after every component it reaches."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: list[list[int]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = edges[node]
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i][0]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                out.append(members)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


def _first_bytes(alts: list[list[_Alt]]) -> tuple[list[bool], list[frozenset[int]]]:
    """Each node's nullability and the bytes its outputs may start with (at most two kept: two are
    enough to know a branch), by a worklist to the least fixpoint."""
    num = len(alts)
    nullable = [False] * num
    first: list[frozenset[int]] = [frozenset()] * num
    users: list[set[int]] = [set() for _ in range(num)]
    for node, node_alts in enumerate(alts):
        for alt in node_alts:
            for ref in alt.refs:
                users[ref].add(node)
    queue = deque(range(num))
    queued = [True] * num
    while queue:
        node = queue.popleft()
        queued[node] = False
        null, start = False, first[node]
        for alt in alts[node]:
            alt_null, alt_first = True, frozenset[int]()
            for elem in alt.elems:
                alt_first = _cap(alt_first | _elem_first(elem, first))
                if not _elem_nullable(elem, nullable):
                    alt_null = False
                    break
            null = null or alt_null
            start = _cap(start | alt_first)
        if null != nullable[node] or start != first[node]:
            nullable[node], first[node] = null, start
            for user in users[node]:
                if not queued[user]:
                    queued[user] = True
                    queue.append(user)
    return nullable, first


def _forcible(alts: list[list[_Alt]], nullable: list[bool], first: list[frozenset[int]]) -> list[bool]:
    """Nodes one of whose outputs may be forced from its start to its end (least fixpoint by a worklist;
    an over-approximation: False only where every output passes a point with two possible next bytes)."""
    num = len(alts)
    forced = [False] * num
    users: list[set[int]] = [set() for _ in range(num)]
    for node, node_alts in enumerate(alts):
        for alt in node_alts:
            for ref in alt.refs:
                users[ref].add(node)
    queue = deque(range(num))
    while queue:
        node = queue.popleft()
        if forced[node] or len(first[node]) > 1:
            continue
        if any(_alt_forcible(alt, forced, nullable, first) for alt in alts[node]):
            forced[node] = True
            queue.extend(users[node])
    return forced


def _alt_forcible(alt: _Alt, forced: list[bool], nullable: list[bool], first: list[frozenset[int]]) -> bool:
    rest_null, rest_first = True, frozenset[int]()
    for elem in reversed(alt.elems):
        if not _elem_forcible(elem, forced, nullable, first, rest_null, rest_first):
            return False
        rest_null, rest_first = _prepend(elem, nullable, first, rest_null, rest_first)
    return True


def _elem_forcible(elem: _Elem, forced: list[bool], nullable: list[bool], first: list[frozenset[int]],
                   rest_null: bool, rest_first: frozenset[int]) -> bool:
    """Whether a forced string may run through ``elem``, followed by a rest with these first bytes."""
    if elem.kind == _LIT:
        return True
    if elem.kind == _ONE_OF:
        return elem.single
    if elem.kind == _STAR:
        return elem.single and not _branches(elem.first, rest_null, rest_first)
    if elem.hi == 0:
        return True
    optional = elem.lo == 0 or nullable[elem.node] or elem.hi == -1 or elem.hi > elem.lo
    if optional and _branches(first[elem.node], rest_null, rest_first):
        return False
    return elem.lo == 0 or forced[elem.node]


def _branches(start: frozenset[int], rest_null: bool, rest_first: frozenset[int]) -> bool:
    """Whether a point where ``start`` or the rest may come next offers two different bytes for sure."""
    return len(start) > 1 or (not rest_null and len(start | rest_first) > 1)


def _elem_first(elem: _Elem, first: list[frozenset[int]]) -> frozenset[int]:
    return first[elem.node] if elem.kind == _REF else elem.first


def _elem_nullable(elem: _Elem, nullable: list[bool]) -> bool:
    if elem.kind == _REF:
        return elem.lo == 0 or nullable[elem.node]
    return elem.kind == _STAR


def _prepend(elem: _Elem, nullable: list[bool], first: list[frozenset[int]], rest_null: bool,
             rest_first: frozenset[int]) -> tuple[bool, frozenset[int]]:
    """Nullability and first bytes of ``elem`` followed by the rest."""
    if _elem_nullable(elem, nullable):
        return rest_null, _cap(_elem_first(elem, first) | rest_first)
    return False, _elem_first(elem, first)


def _cap(bytes_: frozenset[int]) -> frozenset[int]:
    return bytes_ if len(bytes_) <= 2 else frozenset(sorted(bytes_)[:2])


# ---- character classes -----------------------------------------------------------------------------


def _class(negated: bool, bounds: list[int], json_string: bool) -> tuple[bytes | None, bool, frozenset[int]]:
    """A class's shortest (in UTF-8), preferably printable, character (None: it allows none), whether
    it allows exactly one codepoint, and (at most two of) the bytes its characters start with.
    ``bounds``: [lo0, hi0, lo1, hi1, ...] codepoints."""
    ranges = sorted((bounds[i], bounds[i + 1]) for i in range(0, len(bounds) - 1, 2))
    allowed = _complement(ranges) if negated else _merge(ranges)
    excluded = [_SURROGATES] + (list(_JSON_STRING_EXCLUDED) if json_string else [])
    allowed = _subtract(allowed, _merge(excluded))
    single = len(allowed) == 1 and allowed[0][0] == allowed[0][1]
    leads: set[int] = set()
    for a, b in allowed:
        for lo, hi, shift, mark in _UTF8_BANDS:
            if a <= hi and b >= lo and len(leads) < 2:
                leads |= {mark | (max(a, lo) >> shift), mark | (min(b, hi) >> shift)}
    witness = None
    for lo, hi in ((0x20, 0x7E), (0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, _MAX_CODEPOINT)):
        witness = next((chr(max(a, lo)).encode("utf-8") for a, b in allowed if a <= hi and b >= lo), None)
        if witness is not None:
            break
    return witness, single, _cap(frozenset(leads))


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
