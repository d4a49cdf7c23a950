"""Output constraints are measured before decoding: refusals name the field or tool and the construct,
compiled grammars are cached per tenant, and random schemas are refused or compiled, never hang."""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reprise.engine.grammar_compiler import (
    MAX_SCHEMA_DEPTH,
    CheckedGrammar,
    GrammarCompiler,
    GrammarError,
    ebnf_text,
)
from reprise.offline.tiny import TINY_EOS, TINY_VOCAB, byte_level_tokenizer
from serving.records import OutputConstraint, Tool
from serving.tool_calls import FORMATS

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(byte_level_tokenizer(), TINY_VOCAB, [TINY_EOS])


def schema(value: dict) -> OutputConstraint:
    return OutputConstraint(json.dumps(value))


def tools(*pairs: tuple[str, dict], fmt: str = "hermes") -> OutputConstraint:
    return FORMATS[fmt].constraint([Tool(name, "", json.dumps(params)) for name, params in pairs])


def refusal(compiler, constraint: OutputConstraint, max_tokens: int = 100) -> GrammarError:
    with pytest.raises(GrammarError) as info:
        compiler.compile(constraint, tenant="t", max_tokens=max_tokens)
    message = str(info.value)
    assert "/project/" not in message and ".cc:" not in message and not message.startswith("[")
    return info.value


def test_no_finite_value_is_refused_naming_where(compiler) -> None:
    err = refusal(compiler, schema({"allOf": [{"$ref": "#"}]}))
    assert err.kind == "no_finite_output" and err.tool is None
    assert str(err).startswith('the json_schema schema has no finite value: a value at "#" needs another one')
    err = refusal(compiler, schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}))
    assert '"#/properties/a"' in str(err)
    err = refusal(compiler, schema({"type": "string", "pattern": "a*[^\\s\\S]"}))
    assert err.kind == "no_finite_output" and "matches no text" in str(err)


def test_a_tool_without_a_finite_value_is_named(compiler) -> None:
    # (serving.tool_calls rebases the parameters' references: '#' is their own root, as the caller meant)
    loop = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    err = refusal(compiler, tools(("loops", loop)))
    assert err.kind == "no_finite_output" and err.tool == "loops"
    assert str(err).startswith("the parameters schema of tool 'loops' has no finite value: a value at its "
                               "parameters' root needs one at \"#/properties/x\" in its parameters")
    err = refusal(compiler, tools(("f", {"$ref": "#"}), fmt="smollm2"))  # '#' is the parameters themselves
    assert err.tool == "f"


def test_unsupported_schemas_name_the_tool_and_the_construct(compiler) -> None:
    err = refusal(compiler, tools(("fine", {"type": "object"}), ("odd", {"type": "nonsense"})))
    assert err.kind == "unsupported" and err.tool == "odd"
    assert str(err) == "the parameters schema of tool 'odd' cannot be used as a grammar: Unsupported type \"nonsense\""
    err = refusal(compiler, schema({"type": "string", "minLength": 5, "maxLength": 2}))
    assert str(err) == "the json_schema schema cannot be used as a grammar: minLength 5 is greater than maxLength 2"


def test_outputs_that_cannot_fit_max_tokens_are_refused(compiler) -> None:
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                      "minItems": 50}}, "required": ["tags"]}
    err = refusal(compiler, schema(tags), max_tokens=100)
    assert err.kind == "does_not_fit"
    assert "the shortest output the json_schema schema allows is 210 tokens" in str(err)
    assert "max_tokens=100" in str(err)
    assert isinstance(compiler.compile(schema(tags), tenant="t", max_tokens=210), CheckedGrammar)
    # A branch the model may never take still has to fit: xgrammar could force its whole text.
    optional = {"anyOf": [{"type": "null"}, {"type": "string", "minLength": 5000}]}
    err = refusal(compiler, schema(optional), max_tokens=100)
    assert err.kind == "does_not_fit" and 'a value at "#/anyOf/1" needs at least 5002 characters' in str(err)


def test_oversized_and_overdeep_schemas_are_refused_before_parsing(compiler) -> None:
    deep = "[" * (MAX_SCHEMA_DEPTH + 1) + "]" * (MAX_SCHEMA_DEPTH + 1)
    err = refusal(compiler, OutputConstraint('{"enum": ' + deep + "}"))
    assert err.kind == "too_large" and f"nested {MAX_SCHEMA_DEPTH + 2} levels deep" in str(err)
    err = refusal(compiler, OutputConstraint('{"description": "' + "x" * (1 << 20) + '"}'))
    assert err.kind == "too_large"


def test_the_cache_is_per_tenant(compiler) -> None:
    constraint = schema({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    hits, misses = compiler.hits, compiler.misses
    a = compiler.compile(constraint, tenant="tenant-a", max_tokens=50)
    assert (compiler.hits, compiler.misses) == (hits, misses + 1)
    assert compiler.compile(constraint, tenant="tenant-a", max_tokens=50) is a
    assert (compiler.hits, compiler.misses) == (hits + 1, misses + 1)
    b = compiler.compile(constraint, tenant="tenant-b", max_tokens=50)  # B's first compile is a miss
    assert (compiler.hits, compiler.misses) == (hits + 1, misses + 2) and b is not a
    assert compiler._compiler.get_cache_size_bytes() == 0  # xgrammar's own cache (shared) stays off
    # A hit still checks the request's own max_tokens.
    with pytest.raises(GrammarError, match="max_tokens=2"):
        compiler.compile(constraint, tenant="tenant-a", max_tokens=2)


@pytest.mark.parametrize("word", ["Décembre", "é0", "Zürich2", "\u00800"])
def test_non_ascii_literals_compile_to_themselves(compiler, word) -> None:
    """xgrammar's compiler cache rebuilds grammars from printed EBNF, where "\\xe9" + "c" reads back as
    one character U+0E9C; with the cache off the literal stays what the schema says."""
    grammar = compiler.compile(schema({"enum": [word, "a\\x41"]}), tenant="t", max_tokens=20)
    reread = compiler._compiler.compile_grammar(ebnf_text(grammar))  # the text an engine like vLLM gets
    for compiled in (grammar.compiled, reread):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(json.dumps(word, ensure_ascii=False)) and matcher.is_completed()


def test_a_response_format_with_tools_the_model_may_call_allows_either(compiler) -> None:
    """tool_choice auto with tools and a response_format (an agent with tools and a typed output): the
    format's JSON or one tool call, nothing else; both engines get the same union (vLLM as its EBNF)."""
    call = tools(("get_weather", {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}))
    answer = OutputConstraint(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                          "required": ["ok"]}), alternative=call)
    grammar = compiler.compile(answer, tenant="t", max_tokens=100)
    reread = compiler._compiler.compile_grammar(ebnf_text(grammar))
    for compiled in (grammar.compiled, reread):
        tool_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        for text, complete in (('{"ok": true}', True), (tool_call, True), ('{"city": "Oslo"}', False),
                               ("Sure!", False)):
            matcher = xgr.GrammarMatcher(compiled)
            assert (matcher.accept_string(text) and matcher.is_completed()) == complete, text
    # Each alternative must fit max_tokens: the model may enter either.
    with pytest.raises(GrammarError, match="max_tokens=20"):
        compiler.compile(answer, tenant="t", max_tokens=20)


def test_unbounded_forced_strings_turn_jump_forward_off(compiler) -> None:
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"]}
    assert compiler.compile(schema(tree), tenant="t", max_tokens=50).jump_forward
    chain = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                              "kind": {"const": "node"}}, "required": ["next", "kind"]}
    assert not compiler.compile(schema(chain), tenant="t", max_tokens=50).jump_forward


# ---- fuzzing: random small schemas are refused with a GrammarError or compiled, quickly -------------

_KEYS = st.sampled_from(["a", "b", "name", "x y", "kind", "ü"])
_LEAVES = st.one_of(
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "integer"}, {"type": "number"}, {},
                     {"type": "object"}, {"$ref": "#"}, {"type": "string", "format": "email"},
                     {"type": "string", "format": "date-time"}, {"type": "nonsense"}, {"not": {}},
                     {"type": "string", "pattern": "a*[^\\s\\S]"}, {"type": "string", "pattern": "ab+c"}]),
    st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": hi},
              st.integers(0, 300), st.integers(0, 300)),
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
              st.integers(-10**6, 10**6), st.integers(-10**6, 10**6)),
    st.builds(lambda v: {"const": v}, st.one_of(st.integers(), st.text(max_size=12))),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(st.integers(), st.text(max_size=6)), max_size=4)),
)


def _object(props: dict, required: list, closed: bool) -> dict:
    return {"type": "object", "properties": props, "required": [k for k in required if k in props],
            "additionalProperties": not closed}


def _array(items: dict, lo: int, hi: int | None, prefix: list) -> dict:
    out: dict = {"type": "array", "items": items, "minItems": lo}
    if hi is not None:
        out["maxItems"] = hi
    if prefix:
        out["prefixItems"] = prefix
    return out


SCHEMAS = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.builds(_object, st.dictionaries(_KEYS, inner, max_size=4), st.lists(_KEYS, max_size=4), st.booleans()),
    st.builds(_array, inner, st.integers(0, 40), st.one_of(st.none(), st.integers(0, 40)),
              st.lists(inner, max_size=2)),
    st.builds(lambda cs: {"anyOf": cs}, st.lists(inner, min_size=1, max_size=3)),
    st.builds(lambda cs: {"allOf": cs}, st.lists(inner, min_size=1, max_size=2)),
    st.builds(lambda d, r: {"$defs": {"d": d}, **r}, inner, st.just({"$ref": "#/$defs/d"})),
), max_leaves=10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=SCHEMAS, max_tokens=st.integers(1, 300), as_tool=st.booleans(), walk_seed=st.integers(0, 2**16))
def test_random_schemas_are_refused_or_compiled_quickly(compiler, value, max_tokens, as_tool, walk_seed) -> None:
    constraint = tools(("t", value)) if as_tool else schema(value)
    started = time.perf_counter()
    try:
        grammar = compiler.compile(constraint, tenant="fuzz", max_tokens=max_tokens)
    except GrammarError as exc:
        assert exc.kind in ("unsupported", "no_value", "no_finite_output", "does_not_fit", "too_large")
        message = str(exc)
        assert message and "/project/" not in message and ".cc:" not in message
        return
    finally:
        assert time.perf_counter() - started < 5.0, f"compiling took {time.perf_counter() - started:.1f} s"
    bounds = grammar.bounds
    matcher = xgr.GrammarMatcher(grammar.compiled)
    if bounds.shortest_text is not None:  # the shortest output is a complete output of the grammar
        assert matcher.accept_string(bounds.shortest_text) and matcher.is_completed()
    if grammar.jump_forward:  # the claimed bound on forced strings holds along a random walk
        limit = (bounds.max_forced_bytes or 0) + len(constraint.prefix) + len(constraint.suffix)
        walker = xgr.GrammarMatcher(grammar.compiled)
        mask = xgr.allocate_token_bitmask(1, TINY_VOCAB)
        rng = random.Random(walk_seed)
        for _ in range(40):
            if walker.is_terminated():
                break
            try:
                assert len(walker.find_jump_forward_string().encode()) <= limit
            except UnicodeDecodeError:  # inside a multi-byte character (GrammarState drafts nothing then)
                pass
            walker.fill_next_token_bitmask(mask)
            words = mask[0].tolist()
            allowed = [t for t in range(TINY_VOCAB) if (words[t >> 5] >> (t & 31)) & 1]
            assert allowed  # a checked grammar never leaves a state without a next token
            assert walker.accept_token(rng.choice([t for t in allowed if t != TINY_EOS] or allowed))


@pytest.mark.parametrize("value, where, why", [
    ({"anyOf": []}, "its root", "its anyOf is an empty list"),
    ({"oneOf": []}, "its root", "its oneOf is an empty list"),
    ({"type": []}, "its root", "its type is an empty list"),
    ({"type": "string", "enum": []}, "its root", "its enum is an empty list"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, '"#/properties/a"', "its anyOf is an empty list"),
    ({"anyOf": [{"anyOf": []}, {"type": "integer"}]}, '"#/anyOf/0"', "its anyOf is an empty list"),
    ({"type": "array", "items": {"oneOf": []}}, '"#/items"', "its oneOf is an empty list"),
    ({"$defs": {"x": {"anyOf": []}}, "$ref": "#/$defs/x"}, '"#/$defs/x"', "its anyOf is an empty list"),
    ({"const": 1, "type": "string"}, "its root", "its const 1 is not of its type string"),
    ({"const": "x", "enum": ["y"]}, "its root", "its const is not among its enum"),
    ({"enum": [1, True], "type": ["string", "null"]}, "its root", "none of its enum values is of its type"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
      "additionalProperties": False}, "its root", "it requires 'b', which its properties do not name"),
])
def test_a_schema_that_admits_no_value_is_refused_naming_where(compiler, value, where, why) -> None:
    exc = refusal(compiler, schema(value))
    assert exc.kind == "no_value" and exc.tool is None
    assert str(exc).startswith(f"the json_schema schema admits no value: at {where}, {why}"), str(exc)


def test_a_tool_whose_parameters_admit_no_value_is_named(compiler) -> None:
    exc = refusal(compiler, tools(("ok", {"type": "object"}), ("bad", {"type": "object", "properties": {
        "a": {"anyOf": []}}, "required": ["a"]})))
    assert exc.kind == "no_value" and exc.tool == "bad"
    assert 'at "#/properties/a" in its parameters, its anyOf is an empty list' in str(exc)


@pytest.mark.parametrize("value", [
    {"type": "object", "additionalProperties": False},
    {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
    {"enum": [1, "x"], "type": "integer"},
    {"const": 2.0, "type": "integer"},
    {"const": None, "type": ["string", "null"]},
    {"allOf": []},
    {"type": "object", "required": ["z"], "patternProperties": {"^z$": {}}, "additionalProperties": False},
])
def test_schemas_with_values_are_not_refused_for_it(compiler, value) -> None:
    compiler.compile(schema(value), tenant="t", max_tokens=100)
