"""What a grammar's outputs cost at least, read from xgrammar's serialized grammar: shortest outputs,
grammars without a finite output, the longest part, and the bound on forced (jump-forward) strings,
checked against xgrammar's own matcher."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from reprise.engine.grammar_bounds import NoFiniteOutput, UnsupportedGrammar, measure
from reprise.offline.tiny import TINY_EOS, TINY_VOCAB, byte_level_tokenizer

xgr = pytest.importorskip("xgrammar")


def bounds_of(schema: dict | str, **kwargs):
    text = schema if isinstance(schema, str) else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
    return measure(grammar.serialize_json(), expand_regex=lambda p: xgr.Grammar.from_regex(p).serialize_json(),
                   **kwargs)


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo.from_huggingface(byte_level_tokenizer(), vocab_size=TINY_VOCAB,
                                              stop_token_ids=[TINY_EOS])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


TREE = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2},
                                         "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name", "kids"]}
LIST_WITH_CONST = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                                    "kind": {"const": "node"}}, "required": ["next", "kind"]}
LIST_WITH_INT = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                                  "v": {"type": "integer"}}, "required": ["next", "v"]}
ONE_ITEM_ARRAYS = {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1,
                                                "maxItems": 1}]}


@pytest.mark.parametrize("schema,shortest", [
    ({"type": "boolean"}, "true"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 0}'),
    ({"type": "string", "minLength": 3, "maxLength": 9}, '"   "'),
    ({"type": "string", "pattern": "ab+c"}, '"abc"'),
    ({"type": "array", "items": {"enum": ["xyz"]}, "minItems": 2}, '["xyz", "xyz"]'),
    (TREE, '{"name": "  ", "kids": []}'),
    ({}, "0"),
])
def test_shortest_output_is_a_complete_output(compiler, schema, shortest) -> None:
    bounds = bounds_of(schema)
    assert bounds.shortest_text == shortest and bounds.shortest_bytes == len(shortest.encode())
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False)))
    assert matcher.accept_string(shortest) and matcher.is_completed()


@pytest.mark.parametrize("schema,cause,rules", [
    ({"allOf": [{"$ref": "#"}]}, "cycle", ("root",)),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "cycle",
     ("root", "root_prop_0", "root")),
    ({"type": "string", "pattern": "a*[^\\s\\S]"}, "matches_nothing", ("root", "root_1")),
    # a dead branch is refused even though the other branch has a value: the matcher could enter it
    ({"$defs": {"loop": {"type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}}, "required": ["a"]}},
      "anyOf": [{"type": "null"}, {"$ref": "#/$defs/loop"}]}, "cycle", ("defs_loop", "defs_loop_prop_0", "defs_loop")),
])
def test_grammars_without_a_finite_output_are_named(schema, cause, rules) -> None:
    with pytest.raises(NoFiniteOutput) as info:
        bounds_of(schema)
    assert info.value.cause == cause
    if rules is not None:
        assert info.value.rules == rules


def test_longest_part_names_the_innermost_large_part() -> None:
    schema = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 500}}, "required": ["tags"]}]}
    bounds = bounds_of(schema)
    assert bounds.shortest_text == "null"
    assert bounds.longest_part_bytes == len('{"tags": []}') + 500 * 2 + 499 * 2
    rules = [rule for rule, size in bounds.longest_part if size >= 1998]
    assert rules[-1] == "root_case_1_prop_0"  # the array, not the object around it


def test_huge_minimums_are_measured_without_building_them() -> None:
    schema = {"type": "array", "minItems": 10**6, "items": {"type": "array", "minItems": 10**6,
                                                         "items": {"const": "abc"}}}
    bounds = bounds_of(schema, witness_bytes=1 << 20)
    assert bounds.shortest_bytes > 10**12 and bounds.shortest_text is None


def test_forced_strings_are_bounded_unless_they_grow_with_nesting() -> None:
    assert bounds_of(TREE).forced_levels is not None
    assert bounds_of(LIST_WITH_INT).forced_levels is not None
    assert bounds_of({}).max_forced_bytes is not None
    # A constant after a recursive field, or one-item arrays: each level closes with forced text.
    assert bounds_of(LIST_WITH_CONST).max_forced_bytes is None
    assert bounds_of(ONE_ITEM_ARRAYS).max_forced_bytes is None


def random_walk_forced(compiler, schema: dict, seed: int, steps: int = 200) -> int:
    """The longest jump-forward string xgrammar returns along a random walk of allowed tokens."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    mask = xgr.allocate_token_bitmask(1, TINY_VOCAB)
    rng = np.random.default_rng(seed)
    longest = 0
    for _ in range(steps):
        if matcher.is_terminated():
            break
        longest = max(longest, len(matcher.find_jump_forward_string().encode()))
        matcher.fill_next_token_bitmask(mask)
        bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:TINY_VOCAB]
        allowed = torch.nonzero(bits).flatten().tolist()
        non_stop = [t for t in allowed if t != TINY_EOS] or allowed
        assert matcher.accept_token(int(rng.choice(non_stop)))
    return longest


@pytest.mark.parametrize("schema", [TREE, LIST_WITH_INT, {}, {"type": "string", "format": "email"}])
def test_forced_strings_stay_within_the_bound(compiler, schema) -> None:
    bound = bounds_of(schema).max_forced_bytes
    assert bound is not None
    for seed in range(5):
        assert random_walk_forced(compiler, schema, seed) <= bound


def test_a_forced_string_runs_on_into_a_rest_forced_only_at_its_start(compiler) -> None:
    """After ``[-`` the enum's ``1000`` is forced, then the required first item ``, ""`` of the enclosing
    array (a choice between another item and ``]`` only after it): two parts, not one."""
    schema = {"type": "array", "prefixItems": [{"enum": [0, -1000]}], "minItems": 2,
              "items": {"type": "string", "maxLength": 0}}
    bound = bounds_of(schema).max_forced_bytes
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False)))
    assert matcher.accept_string("[-")
    assert matcher.find_jump_forward_string() == '1000, ""'
    assert bound is not None and bound >= len('1000, ""')


def test_nested_forced_text_does_grow_where_no_bound_is_claimed(compiler) -> None:
    grammar = xgr.Grammar.from_json_schema(json.dumps(LIST_WITH_CONST), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    for _ in range(40):
        assert matcher.accept_string('{"next": ')
    assert matcher.accept_string("null")
    assert len(matcher.find_jump_forward_string()) == 40 * len(', "kind": "node"}')


def test_an_unknown_serialization_is_refused() -> None:
    text = json.loads(xgr.Grammar.from_json_schema('{"type": "boolean"}').serialize_json())
    text["__VERSION__"] = "v0"
    with pytest.raises(UnsupportedGrammar, match="v0"):
        measure(json.dumps(text))
