"""Grammar-constrained decoding with speculation: exact constrained greedy output with any drafts, pruned
trees, forced tokens drafted for free, and outputs that always parse under their schema."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from reprise.engine.engine import Engine, EngineConfig
from reprise.engine.grammar import GrammarState, child_links, merge_chain
from reprise.engine.grammar_compiler import GrammarCompiler
from reprise.offline.tiny import TINY_EOS, TINY_VOCAB, byte_level_tokenizer, tiny_llama
from retrieval.draft_tree import DraftTree
from serving.records import OutputConstraint, Request, Tool
from serving.tool_calls import FORMATS
from verifier.runner import ModelRunner
from verifier.testing import full_logits

WEATHER = Tool("get_weather", "Weather of a city", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                     "days": {"type": "integer", "enum": [1, 2, 3]},
                                     "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"]}))
NOTE = Tool("take_note", "Write a note", json.dumps({
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 6}}, "required": ["text"]}))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, TINY_VOCAB, [TINY_EOS])


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=11)


def constrained_greedy(model, compiled, prompt: list[int], max_new: int) -> list[int]:
    """The reference: one plain forward per token, the grammar's mask on the last row, argmax."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled.compiled)
    mask = xgr.allocate_token_bitmask(1, TINY_VOCAB)
    out: list[int] = []
    while len(out) < max_new:
        logits = full_logits(model, prompt + out)[-1:].clone()
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        token = int(logits.argmax())
        out.append(token)
        assert matcher.accept_token(token)
        if token == TINY_EOS:
            break
    return out


class ListProposer:
    """Drafts from a fixed continuation (``kind`` "right"), random tokens ("wrong"), or nothing."""

    def __init__(self, kind: str, truth: list[int], prompt_len: int) -> None:
        self.kind, self.truth, self.prompt_len = kind, truth, prompt_len
        self.rng = np.random.default_rng(0)

    def begin(self, tenant, session_id, prompt_ids, request_id=""):
        return _ListSession(self, list(prompt_ids))


class _ListSession:
    def __init__(self, owner: ListProposer, context: list[int]) -> None:
        self.owner, self.context = owner, context

    def propose(self, budget: int) -> DraftTree:
        o = self.owner
        if o.kind == "empty":
            return DraftTree.empty()
        if o.kind == "right":
            done = len(self.context) - o.prompt_len
            return DraftTree.chain(o.truth[done: done + min(budget, 6)], source="test")
        n = min(budget, 8)
        parents = np.array([-1] + [int(o.rng.integers(-1, i)) for i in range(1, n)], np.int32)
        return DraftTree(o.rng.integers(0, TINY_VOCAB, n).astype(np.int32), parents, np.full(n, 0.6, np.float32),
                         source="test")

    def commit(self, verified) -> None:
        self.context += [int(t) for t in verified.token_ids]

    def finish(self, record: bool = True) -> None:
        pass


def run_engine(model, tokenizer, proposer, compiled, prompt, max_new, speculate=True):
    engine = Engine(ModelRunner(model, num_slots=2, max_len=512, max_draft_nodes=16), proposer, tokenizer,
                    EngineConfig(eos_token_ids=(TINY_EOS,)))
    reports = []
    engine.config = EngineConfig(eos_token_ids=(TINY_EOS,), observer=type("O", (), {
        "on_step": lambda self, r: reports.extend(r), "on_finish": lambda self, r: None})())
    handle = engine.submit(Request.of_tokens(prompt, max_new_tokens=max_new, speculate=speculate), grammar=compiled)
    engine.run_until_idle()
    return handle.wait(), reports


@pytest.mark.parametrize("fmt,tools", [("smollm2", [WEATHER]), ("hermes", [WEATHER, NOTE])])
def test_output_is_exactly_constrained_greedy_with_any_draft(model, tokenizer, compiler, fmt, tools) -> None:
    compiled = compiler.compile(FORMATS[fmt].constraint(tools), tenant="t", max_tokens=120)
    prompt = tokenizer.encode("<|begin|>user\nweather?<|end|>\n<|begin|>assistant\n")
    truth = constrained_greedy(model, compiled, prompt, 120)
    assert truth[-1] == TINY_EOS
    parsed = FORMATS[fmt].parse(tokenizer.decode(truth, skip_special_tokens=True))
    assert parsed is not None and len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    args = json.loads(call.arguments)
    if call.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo", "Lima") and args["days"] in (1, 2, 3)
        assert isinstance(args["metric"], bool)
    else:
        assert call.name == "take_note" and isinstance(args["text"], str)
    for kind, speculate in (("right", True), ("wrong", True), ("empty", True), ("empty", False)):
        result, reports = run_engine(model, tokenizer, ListProposer(kind, truth, len(prompt)), compiled, prompt, 120,
                                     speculate)
        assert list(result.token_ids) == truth, (kind, speculate)
        assert result.finish_reason == "eos"
        if speculate:  # the forced text ("<tool_call>...{\"city\": \"") is drafted for free
            assert result.usage.steps < len(truth) and result.usage.accepted_tokens > 0, kind
        else:
            assert result.usage.steps == len(truth) and all(r.num_draft == 0 for r in reports)


def test_json_schema_output_parses(model, tokenizer, compiler) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [4, 5]}},
              "required": ["ok", "n"]}
    compiled = compiler.compile(OutputConstraint(json.dumps(schema)), tenant="t", max_tokens=60)
    prompt = tokenizer.encode("give json")
    result, _ = run_engine(model, tokenizer, ListProposer("wrong", [], len(prompt)), compiled, prompt, 60)
    value = json.loads(result.text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (4, 5)


def test_constrain_prunes_forbidden_nodes_and_masks_rows(tokenizer, compiler) -> None:
    compiled = compiler.compile(OutputConstraint('{"type": "boolean"}'), tenant="t", max_tokens=8)
    state = GrammarState(compiled, TINY_VOCAB, tokenizer)
    t, f, r, x = (tokenizer.encode(c)[0] for c in "tfrx")
    # root -> t -> r (ok: "tr..."), root -> x (forbidden) -> t (below a forbidden node), root -> f
    tree = DraftTree(np.array([t, r, x, t, f], np.int32), np.array([-1, 0, -1, 2, -1], np.int32),
                     np.full(5, 0.5, np.float32))
    kept, keep, mask = state.constrain(tree, np.arange(5), room=5, jump_forward=False)
    assert kept.token_ids.tolist() == [t, r, f] and keep.tolist() == [0, 1, 4]
    assert kept.parents.tolist() == [-1, 0, -1]
    allowed = lambda row: {c for c in range(TINY_VOCAB) if (int(mask[row, c >> 5]) >> (c & 31)) & 1}
    assert allowed(0) == {t, f} and allowed(1) == {r} and allowed(2) == {tokenizer.encode("u")[0]}
    assert allowed(3) == {tokenizer.encode("a")[0]}


def test_forced_chain_merges_into_the_tree(tokenizer, compiler) -> None:
    compiled = compiler.compile(OutputConstraint('{"type": "object", "properties": {"abc": {"type": "boolean"}}, '
                                                 '"required": ["abc"]}'), tenant="t", max_tokens=32)
    state = GrammarState(compiled, TINY_VOCAB, tokenizer)
    forced = state.forced_tokens(32)
    assert tokenizer.decode(forced) == '{"abc": '
    brace = tokenizer.encode("{")[0]
    tree = DraftTree.chain([brace, tokenizer.encode("x")[0]])
    merged, keep = merge_chain(tree, np.arange(2), forced)
    assert merged.token_ids.tolist()[:2] == tree.token_ids.tolist() and keep.tolist()[:2] == [0, 1]
    assert merged.parents.tolist()[2] == 0 and (keep[2:] == -1).all()
    assert tokenizer.decode(merged.token_ids[[0] + list(range(2, len(merged)))].tolist()) == '{"abc": '
    kept, keep, _ = state.constrain(tree, np.arange(2), room=16)
    assert tokenizer.decode(kept.token_ids.tolist()) == '{"abc": '  # "x" pruned, the forced chain kept
    assert keep.tolist()[0] == 0 and (keep[1:] == -1).all()


def test_child_links() -> None:
    first, sibling = child_links(np.array([-1, 0, 0, -1, 2]))
    assert first.tolist() == [1, 2, -1, 5, -1, -1]
    assert sibling.tolist() == [-1, 4, 3, -1, -1, -1]


def test_bad_schema_is_a_value_error(compiler) -> None:
    with pytest.raises(ValueError, match="json_schema schema cannot be used"):
        compiler.compile(OutputConstraint('{"type": "nonsense"}'), tenant="t", max_tokens=8)


def test_mask_application_matches_xgrammar() -> None:
    import xgrammar as xgr

    from verifier.sampling import apply_token_mask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask)
    assert torch.equal(apply_token_mask(logits.clone(), mask), expected)
