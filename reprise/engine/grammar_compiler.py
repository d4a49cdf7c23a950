"""Output constraints measured and compiled into grammars, on the caller's (worker) thread, before any
decoding: ``GrammarCompiler.compile(constraint, tenant=..., max_tokens=...)`` returns the
``CheckedGrammar`` a request is submitted with (``Engine.submit(request, grammar=...)``), or raises ``GrammarError`` (a ValueError) saying in
the client's terms why the constraint cannot be decoded under:

* ``too_large``: the schema's text beyond ``MAX_CONSTRAINT_CHARS`` or nested beyond ``MAX_SCHEMA_DEPTH``
  (checked before any parser sees it);
* ``unsupported``: xgrammar cannot convert it (its message, without its timestamp and source path,
  naming the tool whose parameters failed);
* ``no_value``: a part of the schema admits no value (an empty ``anyOf``, a ``const`` of another type
  than ``type``...: reprise/engine/schema_check.py), which xgrammar would turn into a grammar that writes
  what the schema refuses;
* ``no_finite_output``: a reachable part has no finite value (a $ref cycle through required fields, a
  pattern that matches nothing), with where in the schema (reprise/engine/grammar_bounds.py);
* ``does_not_fit``: its shortest complete output (the tokenizer's count) is more than ``max_tokens``, or
  one of its parts needs more characters than ``max_tokens`` tokens can hold.

Measured and compiled constraints are cached per tenant: a tenant never hits on what another tenant
compiled, so compile times reveal nothing of what others sent. xgrammar's own compiler cache, which
would be shared (and which garbles some non-ASCII literals, see ``GrammarCompiler``), is off.
xgrammar is imported lazily (it imports torch).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reprise.engine.grammar_bounds import GrammarBounds, NoFiniteOutput, UnsupportedGrammar, measure
from reprise.engine.schema_check import find_empty
from serving.records import OutputConstraint

MAX_CONSTRAINT_CHARS = 1 << 20  # a constraint's schema text (every tool's parameters together)
MAX_SCHEMA_DEPTH = 64  # nesting of the schema's JSON (tool calls add 3 levels)
MAX_GRAMMAR_RULES = 100_000  # rules of the converted grammar, regex expansions included
MAX_JUMP_FORWARD_BYTES = 1 << 16  # grammars whose forced strings may be longer decode without jump-forward
MAX_WITNESS_BYTES = 1 << 18  # a longer shortest output is counted in tokens by a lower bound, not tokenized
MAX_CACHED_TENANTS = 32  # tenants whose caches are kept (the least recently used one goes first)
MAX_CACHED_PER_TENANT = 32  # measured constraints kept per tenant
MAX_CACHED_BYTES_PER_TENANT = 16 << 20  # compiled grammars kept per tenant (xgrammar's memory_size_bytes)


class GrammarError(ValueError):
    """A constraint the engine cannot decode under, said in the client's terms. ``kind``:
    ``too_large`` (the schema's size or nesting), ``unsupported`` (xgrammar cannot convert it),
    ``no_value`` (a part of the schema admits no value), ``no_finite_output`` (a part admits no finite value), ``does_not_fit`` (its shortest output, or one
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
    its bounds: what ``Engine.submit`` takes as a request's grammar, and the only thing ``GrammarState`` takes, so
    the engine thread never starts on a grammar nobody measured. ``jump_forward``: its forced strings
    are bounded (``GrammarBounds.max_forced_bytes``, at most ``MAX_JUMP_FORWARD_BYTES``), so the engine
    may ask xgrammar for them; otherwise it decodes without jump-forward."""

    compiled: Any
    bounds: GrammarBounds
    jump_forward: bool


@dataclass(slots=True)
class _Entry:
    """One tenant's measured (and, once decoded under, compiled) constraint."""

    bounds: GrammarBounds  # of the whole output: prefix, schema value, suffix
    shortest_tokens: int  # tokens of a shortest complete output (the tokenizer's count)
    grammar: CheckedGrammar | None = None
    num_bytes: int = 0  # the compiled grammar's memory
    body: Any = None  # the schema's converted grammar, until it is compiled
    alternative: _Entry | None = None  # the constraint's alternative, measured on its own


@dataclass(slots=True)
class _TenantCache:
    """One tenant's measured constraints and compiled grammars."""

    entries: OrderedDict[OutputConstraint, _Entry] = field(default_factory=OrderedDict)
    num_bytes: int = 0


class GrammarCompiler:
    """Measures and compiles ``OutputConstraint`` records for one tokenizer.

    ``compile(constraint, tenant=..., max_tokens=...)`` refuses (``GrammarError``) a schema that is too
    large, that xgrammar cannot convert, whose grammar has a part without a finite value, or whose
    shortest complete output (or one of whose parts) needs more than ``max_tokens``; so decoding never
    starts on a grammar that cannot end (reprise/engine/grammar_bounds.py). Measured constraints and
    compiled grammars are cached per tenant (agents repeat their schemas): a tenant never gets a hit on
    what another tenant compiled, so compile times do not reveal what others sent. xgrammar's own
    compiler cache stays off: it would be shared across tenants, and xgrammar 0.2.8 rebuilds a cached
    grammar from its printed EBNF, where a literal's ``\\xe9`` before a hex digit reads back as another
    character (``"Décembre"`` would become unwritable). Memory: at most ``MAX_CACHED_TENANTS`` tenants,
    each ``MAX_CACHED_BYTES_PER_TENANT`` of compiled grammars. Runs on the caller's (worker) thread;
    thread-safe.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr  # lazy: it imports torch and takes seconds

        self._xgr = xgr
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._tokenizer = tokenizer
        # The most bytes one token writes: a part longer than max_tokens times this can never be emitted.
        self.max_token_bytes = max((len(piece) for piece in self._info.decoded_vocab), default=1) or 1
        self._tenants: OrderedDict[str, _TenantCache] = OrderedDict()
        self._lock = threading.Lock()  # worker threads compile concurrently
        self.vocab_size = vocab_size
        self.hits = 0
        self.misses = 0

    def compile(self, constraint: OutputConstraint, *, tenant: str, max_tokens: int) -> CheckedGrammar:
        """The compiled grammar of ``constraint`` for ``tenant``'s request of at most ``max_tokens``
        output tokens; ``GrammarError`` (a ValueError) saying why when it cannot be decoded under."""
        cache, entry = self._entry(constraint, tenant, max_tokens)
        if entry.grammar is not None:
            return entry.grammar
        try:
            compiled = self._compiler.compile_grammar(self._grammar(constraint, entry.body))
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for what it cannot build
            raise GrammarError(f"{_label(constraint, None)} cannot be used as a grammar: {_clean(exc)}",
                               kind="unsupported") from None
        grammar = CheckedGrammar(compiled, entry.bounds, _jump_forward(constraint, entry))
        with self._lock:
            if entry.grammar is None and cache.entries.get(constraint) is entry:
                entry.grammar, entry.num_bytes, entry.body = grammar, int(compiled.memory_size_bytes), None
                cache.num_bytes += entry.num_bytes
                while cache.num_bytes > MAX_CACHED_BYTES_PER_TENANT and len(cache.entries) > 1:
                    cache.num_bytes -= cache.entries.popitem(last=False)[1].num_bytes
        return grammar

    def check(self, constraint: OutputConstraint, *, tenant: str, max_tokens: int) -> GrammarBounds:
        """``compile``'s checks without compiling (for an engine that compiles the grammar itself)."""
        return self._entry(constraint, tenant, max_tokens)[1].bounds

    def _entry(self, constraint: OutputConstraint, tenant: str, max_tokens: int) -> tuple[_TenantCache, _Entry]:
        with self._lock:
            cache = self._tenants.get(tenant)
            if cache is None:
                cache = self._tenants[tenant] = _TenantCache()
                while len(self._tenants) > MAX_CACHED_TENANTS:
                    self._tenants.popitem(last=False)
            self._tenants.move_to_end(tenant)
            entry = cache.entries.get(constraint)
            if entry is not None:
                self.hits += 1
                cache.entries.move_to_end(constraint)
        if entry is None:
            entry = self._measure(constraint)
            with self._lock:
                self.misses += 1
                entry = cache.entries.setdefault(constraint, entry)  # a concurrent miss may have stored it first
                while len(cache.entries) > MAX_CACHED_PER_TENANT:
                    cache.num_bytes -= cache.entries.popitem(last=False)[1].num_bytes
        self._check_fits(constraint, entry, max_tokens)
        return cache, entry

    def _measure(self, constraint: OutputConstraint) -> _Entry:
        """The constraint's bounds; an alternative is measured on its own (each must be a possible output)."""
        entry = self._measure_one(constraint)
        if constraint.alternative is not None:
            entry.alternative = self._measure(constraint.alternative)
        return entry

    def _measure_one(self, constraint: OutputConstraint) -> _Entry:
        text = constraint.schema
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise GrammarError(f"{_label(constraint, None)} has {len(text)} characters; at most "
                               f"{MAX_CONSTRAINT_CHARS} are allowed", kind="too_large")
        depth = json_depth(text)
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{_label(constraint, None)} is nested {depth} levels deep; at most "
                               f"{MAX_SCHEMA_DEPTH} are allowed", kind="too_large")
        _check_values(constraint)
        try:
            body = self._xgr.Grammar.from_json_schema(text, any_whitespace=False)
        except Exception as exc:  # noqa: BLE001 - xgrammar's converter raises RuntimeError naming the construct
            tool = _failing_tool(self._xgr, constraint)
            raise GrammarError(f"{_label(constraint, tool)} cannot be used as a grammar: {_clean(exc)}",
                               kind="unsupported", tool=tool) from None
        literal = len(constraint.prefix.encode()) + len(constraint.suffix.encode())
        try:
            body_bounds = measure(body.serialize_json(), expand_regex=self._expand_regex,
                                  witness_bytes=MAX_WITNESS_BYTES, max_nodes=MAX_GRAMMAR_RULES)
        except NoFiniteOutput as exc:
            raise _no_finite_output(constraint, exc) from None
        except UnsupportedGrammar as exc:
            raise GrammarError(f"{_label(constraint, None)} cannot be used as a grammar: {exc}",
                               kind="unsupported") from None
        shortest = None if body_bounds.shortest_text is None else \
            constraint.prefix + body_bounds.shortest_text + constraint.suffix
        bounds = GrammarBounds(body_bounds.shortest_bytes + literal, shortest, body_bounds.longest_part,
                               body_bounds.forced_levels, body_bounds.num_rules)
        if shortest is None:  # longer than any output: a lower bound is enough to refuse it
            tokens = math.ceil(bounds.shortest_bytes / self.max_token_bytes)
        else:
            tokens = len(self._tokenizer.encode(shortest, add_special_tokens=False))
        return _Entry(bounds, tokens, body=body)

    def _check_fits(self, constraint: OutputConstraint, entry: _Entry, max_tokens: int) -> None:
        """Every alternative must fit: the model may enter any of them."""
        if constraint.alternative is not None and entry.alternative is not None:
            self._check_fits(constraint.alternative, entry.alternative, max_tokens)
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

    def _grammar(self, constraint: OutputConstraint, body: Any) -> Any:
        """The literal prefix, the schema's value (``body``, converted with any_whitespace=False: compact
        JSON with json.dumps' separators, no free whitespace for a model to loop in, and the same text a
        reply sent back in a later request renders to, serving/tool_calls.py), the literal suffix."""
        xgr = self._xgr
        if body is None:
            body = xgr.Grammar.from_json_schema(constraint.schema, any_whitespace=False)
        parts = [xgr.Grammar.from_ebnf(f"root ::= {_literal(constraint.prefix)}")] if constraint.prefix else []
        parts.append(body)
        if constraint.suffix:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {_literal(constraint.suffix)}"))
        grammar = xgr.Grammar.concat(*parts) if len(parts) > 1 else body
        if constraint.alternative is not None:
            grammar = xgr.Grammar.union(grammar, self._grammar(constraint.alternative, None))
        return grammar

    def _expand_regex(self, pattern: str) -> str:
        return str(self._xgr.Grammar.from_regex(pattern).serialize_json())


def _jump_forward(constraint: OutputConstraint, entry: _Entry) -> bool:
    """Whether every alternative's forced strings (the schema value's and the literals) stay bounded."""
    forced = entry.bounds.max_forced_bytes
    literal = len(constraint.prefix.encode()) + len(constraint.suffix.encode())
    if forced is None or forced + literal > MAX_JUMP_FORWARD_BYTES:
        return False
    if constraint.alternative is not None and entry.alternative is not None:
        return _jump_forward(constraint.alternative, entry.alternative)
    return True


_EBNF_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)


def ebnf_text(grammar: CheckedGrammar) -> str:
    """The grammar as EBNF text that reads back as itself (for an engine that takes grammar text, such
    as vLLM): xgrammar 0.2.8 prints U+0080..U+00FF as ``\\xHH``, which its parser reads on into a
    following hex digit (``\\xe9c`` is U+0E9C, so ``"Décembre"`` becomes unwritable); printed here as
    ``\\u00HH`` (four digits, unambiguous)."""
    return _EBNF_ESCAPE.sub(lambda m: "\\u00" + m.group(1)[1:] if len(m.group(1)) == 3 else m.group(0),
                            str(grammar.compiled.grammar))


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def json_depth(text: str) -> int:
    """How deeply ``text``'s JSON nests (brackets outside strings), without parsing it: a cheap bound
    checked before any recursive parser sees the text (a regular expression and a cumulative sum)."""
    data = np.frombuffer(_JSON_STRING.sub("", text).encode(), dtype=np.uint8)
    steps = ((data == ord("[")) | (data == ord("{"))).astype(np.int64) - ((data == ord("]")) | (data == ord("}")))
    return int(np.cumsum(steps).max()) if len(steps) else 0


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
    """(name, call schema) of each tool of a ``tool_calls`` constraint (serving.tool_calls builds one
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


def _check_values(constraint: OutputConstraint) -> None:
    """``GrammarError`` (``no_value``) naming the first part of the constraint's schema (or of an
    alternative's) that admits no value."""
    try:
        schema = json.loads(constraint.schema)
    except ValueError:
        return  # xgrammar's converter names what is wrong with it
    empty = find_empty(schema)
    if empty is not None:
        tool, where = _where(constraint, schema, empty[0])
        where = "its root" if where == '"#"' else where
        raise GrammarError(f"{_label(constraint, tool)} admits no value: at {where}, {empty[1]}", kind="no_value",
                           tool=tool)
    if constraint.alternative is not None:
        _check_values(constraint.alternative)


def _dedupe_where(items: Any) -> list[str]:
    out: list[str] = []
    for item in items:
        if not out or out[-1] != item:
            out.append(item)
    return out


def _locate(constraint: OutputConstraint, rule: str) -> tuple[str | None, str]:
    """Where in the schema an xgrammar rule comes from, as (tool, JSON pointer in the tool's parameters
    or the schema). xgrammar's converter names a rule after the reference it was made for (``root``,
    ``defs_<name>`` for ``#/$defs/<name>``: the pointer's segments joined by ``_``), then ``_prop_<i>``
    (the i-th property), ``_case_<i>`` (anyOf/oneOf), ``_item_<i>`` (prefixItems), ``_additional``
    (items); other suffixes are its helpers, where reading stops."""
    try:
        schema = json.loads(constraint.schema)
    except ValueError:
        return None, repr(rule)
    pointer = _pointer(rule.split("/")[0], schema)
    if pointer is None:
        return None, f"its grammar rule {rule!r}"
    return _where(constraint, schema, pointer)


def _where(constraint: OutputConstraint, schema: Any, pointer: str) -> tuple[str | None, str]:
    """(tool, where) of a JSON pointer into the constraint's schema: inside a tool's parameters, a
    pointer into them."""
    for i, (name, _) in enumerate(_tools(constraint)):
        inline = f"#/anyOf/{i}/properties/arguments" if "anyOf" in schema else "#/properties/arguments"
        for base in (inline, f"#/$defs/{_escape(name)}"):  # parameters with references live in $defs
            if pointer == base:
                return name, "its parameters' root"
            if pointer.startswith(base + "/"):
                return name, f'"#{pointer[len(base):]}" in its parameters'
    if constraint.name == "tool_calls":
        return None, "the tool-call object"
    return None, f'"{pointer}"'


def _pointer(rule: str, schema: Any) -> str | None:
    node, path = schema, "#"
    if rule == "root" or rule.startswith("root_"):
        rest = rule[len("root"):]
    else:  # a reference's target: walk its segments (longest key first; "$defs" is written "defs")
        rest = "_" + rule
        while rest:
            keys = list(node) if isinstance(node, dict) else [str(i) for i in range(len(node))] \
                if isinstance(node, list) else []
            fits = [k for k in keys if rest == "_" + k.lstrip("$") or rest.startswith("_" + k.lstrip("$") + "_")]
            if not fits:
                break
            key = max(fits, key=len)
            node = node[key] if isinstance(node, dict) else node[int(key)]
            path, rest = f"{path}/{_escape(key)}", rest[len(key.lstrip("$")) + 1:]
        if path == "#":
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
