"""Nothing a request carries can stop the engine: issue 22's reproductions against the real engine (tiny
model, real byte-level tokenizer), and batches in which one request fails while the others finish
exactly as they would alone."""

from __future__ import annotations

import json
import threading

import pytest

from reprise.engine.engine import Engine, EngineConfig
from reprise.engine.grammar import GrammarState
from reprise.engine.grammar_compiler import CheckedGrammar, GrammarCompiler, GrammarError
from reprise.offline.tiny import TINY_EOS, TINY_VOCAB, byte_level_tokenizer, tiny_llama
from retrieval.registry import make_proposer
from serving.records import OutputConstraint, Request, Tool
from serving.tool_calls import FORMATS
from verifier.runner import ModelRunner

xgr = pytest.importorskip("xgrammar")

BOOLEAN = OutputConstraint('{"type": "boolean"}')
CITY = OutputConstraint(json.dumps({"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["city", "days"]}))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, TINY_VOCAB, [TINY_EOS])


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=11)


def make_engine(model, tokenizer, num_slots: int = 4, **config) -> Engine:
    return Engine(ModelRunner(model, num_slots=num_slots, max_len=512, max_draft_nodes=16), make_proposer("reprise"),
                  tokenizer, EngineConfig(eos_token_ids=(TINY_EOS,), **config))


def request(tokenizer, grammar=None, prompt: str = "hi", **params) -> dict:
    """``Engine.submit``'s arguments for a request of ``prompt`` under ``grammar``."""
    return {"request": Request.of_tokens(tokenizer.encode(prompt), **params), "grammar": grammar}


def run_alone(model, tokenizer, req: dict):
    engine = make_engine(model, tokenizer)
    handle = engine.submit(**req)
    engine.run_until_idle()
    return handle.wait()


def unchecked(compiler, schema: str) -> CheckedGrammar:
    """A grammar the compiler would refuse, compiled behind its back: what the engine must survive."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    healthy = compiler.compile(BOOLEAN, tenant="t", max_tokens=8)
    return CheckedGrammar(compiler._compiler.compile_grammar(grammar), healthy.bounds, jump_forward=False)


# ---- issue 22's reproductions -------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_that_ends_before_min_tokens_ends_the_output_there(model, tokenizer, compiler, temperature) -> None:
    """max_tokens 40, min_tokens 30, schema boolean: the grammar allows nothing but EOS after "true"."""
    grammar = compiler.compile(BOOLEAN, tenant="t", max_tokens=40)
    result = run_alone(model, tokenizer, request(tokenizer, grammar, temperature=temperature, seed=3,
                                                 max_new_tokens=40, min_new_tokens=30))
    assert result.finish_reason == "eos" and json.loads(result.text) in (True, False)
    assert result.token_ids[-1] == TINY_EOS and len(result.token_ids) < 30


def test_a_forced_tool_call_with_min_tokens_90_parses(model, tokenizer, compiler) -> None:
    tool = Tool("get_weather", "", json.dumps({"type": "object", "properties": {"days": {"type": "integer"}},
                                               "required": ["days"]}))
    constraint = FORMATS["smollm2"].constraint([tool])
    grammar = compiler.compile(constraint, tenant="t", max_tokens=120)
    result = run_alone(model, tokenizer, request(tokenizer, grammar, max_new_tokens=120, min_new_tokens=90))
    assert result.finish_reason == "eos"
    parsed = FORMATS["smollm2"].parse(result.text)
    assert parsed is not None and parsed.tool_calls[0].name == "get_weather"
    assert isinstance(json.loads(parsed.tool_calls[0].arguments)["days"], int)


@pytest.mark.parametrize("constraint,kind", [
    (OutputConstraint('{"allOf": [{"$ref": "#"}]}'), "no_finite_output"),
    (OutputConstraint('{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}'), "no_finite_output"),
    (FORMATS["smollm2"].constraint([Tool("f", "", '{"$ref": "#"}')]), "no_finite_output"),
    (OutputConstraint('{"type": "array", "items": {"type": "boolean"}, "minItems": 200}'), "does_not_fit"),
])
def test_grammars_that_cannot_end_never_reach_the_engine(model, tokenizer, compiler, constraint, kind) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(constraint, tenant="t", max_tokens=40)
    assert info.value.kind == kind
    # and an unchecked grammar object is refused by the engine itself, for that request alone
    engine = make_engine(model, tokenizer)
    bad = engine.submit(**request(tokenizer, grammar="not a checked grammar"))
    good = engine.submit(**request(tokenizer, compiler.compile(CITY, tenant="t", max_tokens=60), max_new_tokens=60))
    engine.run_until_idle()
    with pytest.raises(TypeError, match="GrammarCompiler.compile"):
        bad.wait()
    assert bad.result is not None and bad.result.finish_reason == "error"
    assert set(json.loads(good.wait().text)) == {"city", "days"}


# ---- one request fails, the others finish as they would alone ---------------------------------------


def test_one_failing_request_ends_alone_and_the_step_goes_on(model, tokenizer, compiler) -> None:
    city = compiler.compile(CITY, tenant="t", max_tokens=60)
    healthy = [request(tokenizer, city, prompt="weather?", max_new_tokens=60),
               request(tokenizer, None, prompt="tell me", max_new_tokens=24)]
    alone = [run_alone(model, tokenizer, r) for r in healthy]

    engine = make_engine(model, tokenizer, num_slots=4)
    dead_end = engine.submit(**request(tokenizer, unchecked(compiler, '{"allOf": [{"$ref": "#"}]}'), max_new_tokens=20))
    handles = [engine.submit(**r) for r in healthy]

    def broken_consumer(ids, text):
        raise ConnectionError("client went away")

    broken = engine.submit(**request(tokenizer, city, prompt="x", max_new_tokens=20), on_stream=broken_consumer)
    engine.run_until_idle()
    with pytest.raises(GrammarError, match="allows no token after 0 tokens") as info:
        dead_end.wait()
    assert info.value.kind == "dead_end" and dead_end.result.finish_reason == "error"
    with pytest.raises(ConnectionError):
        broken.wait()
    for handle, expected in zip(handles, alone):
        result = handle.wait()
        assert result.token_ids == expected.token_ids and result.finish_reason == expected.finish_reason
    assert engine.runner.num_free_slots == 4  # every slot came back
    again = engine.submit(**request(tokenizer, city, max_new_tokens=60))
    engine.run_until_idle()
    assert set(json.loads(again.wait().text)) == {"city", "days"}


def test_a_verification_failure_of_one_request_ends_only_it(model, tokenizer) -> None:
    prompts = ["one", "two", "three"]
    alone = [run_alone(model, tokenizer, request(tokenizer, prompt=p, max_new_tokens=16)) for p in prompts]
    engine = make_engine(model, tokenizer, num_slots=3)
    handles = [engine.submit(**request(tokenizer, prompt=p, max_new_tokens=16)) for p in prompts]
    original, poisoned = engine.runner.verify, {}

    def verify(steps):  # the second request's rows fail (as a NaN distribution would), whatever the batch
        if any(s.slot == poisoned.get("slot") for s in steps):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return original(steps)

    engine.step()  # admitted and stepped once together
    poisoned["slot"] = next(a.slot for a in engine._active if a.handle is handles[1])
    engine.runner.verify = verify
    engine.run_until_idle()
    with pytest.raises(RuntimeError, match="probability tensor"):
        handles[1].wait()
    for i in (0, 2):
        assert handles[i].wait().token_ids == alone[i].token_ids


def test_failing_history_sink_and_observer_do_not_stop_the_engine(model, tokenizer) -> None:
    class BrokenObserver:
        def on_step(self, reports):
            raise KeyError("metrics")

        def on_finish(self, result):
            raise KeyError("metrics")

    def sink(result):
        raise OSError("disk full")

    engine = make_engine(model, tokenizer, history_sink=sink, observer=BrokenObserver())
    handles = [engine.submit(**request(tokenizer, prompt=p, max_new_tokens=8)) for p in ("a", "b")]
    engine.run_until_idle()
    for handle in handles:
        assert handle.wait().finish_reason in ("length", "eos")
        assert handle.stored is not None and handle.stored.wait(0) and not handle.stored.ok
        assert "disk full" in handle.stored.error


def test_the_engine_thread_survives_a_request_that_cannot_go_on(model, tokenizer, compiler) -> None:
    """The serving shape: Engine.serve on its own thread, a dead-end grammar among healthy requests."""
    engine = make_engine(model, tokenizer)
    stop = threading.Event()
    thread = threading.Thread(target=engine.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        bad = engine.submit(**request(tokenizer, unchecked(compiler, '{"allOf": [{"$ref": "#"}]}')))
        with pytest.raises(GrammarError):
            bad.wait(60)
        good = engine.submit(**request(tokenizer, compiler.compile(CITY, tenant="t", max_tokens=60), max_new_tokens=60))
        assert set(json.loads(good.wait(60).text)) == {"city", "days"}
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(10)


# ---- the grammar's masks and min_tokens -------------------------------------------------------------


def test_min_tokens_holds_eos_back_only_where_the_grammar_allows_more(tokenizer, compiler) -> None:
    import numpy as np

    from retrieval.draft_tree import DraftTree

    def allowed(state) -> set[int]:
        _, _, mask = state.constrain(DraftTree.empty(), np.zeros(0, np.int64), room=0, jump_forward=False)
        return {t for t in range(TINY_VOCAB) if (int(mask[0, t >> 5]) >> (t & 31)) & 1}

    number = compiler.compile(OutputConstraint('{"type": "integer"}'), tenant="t", max_tokens=30)
    state = GrammarState(number, TINY_VOCAB, tokenizer, min_new_tokens=30, suppress_ids=(TINY_EOS,))
    state.advance(tokenizer.encode("1"))
    assert TINY_EOS not in allowed(state) and tokenizer.encode("2")[0] in allowed(state)
    free = GrammarState(number, TINY_VOCAB, tokenizer)
    free.advance(tokenizer.encode("1"))
    assert TINY_EOS in allowed(free)

    boolean = compiler.compile(BOOLEAN, tenant="t", max_tokens=30)
    state = GrammarState(boolean, TINY_VOCAB, tokenizer, min_new_tokens=30, suppress_ids=(TINY_EOS,))
    state.advance(tokenizer.encode("true"))
    assert allowed(state) == {TINY_EOS}  # nothing else: the end is let through
    with pytest.raises(GrammarError, match="refused token"):
        state.advance(tokenizer.encode("x"))


def test_unbounded_forced_text_decodes_without_jump_forward(model, tokenizer, compiler) -> None:
    chain = OutputConstraint(json.dumps({"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "kind": {"const": "node"}}, "required": ["next", "kind"]}))
    grammar = compiler.compile(chain, tenant="t", max_tokens=200)
    assert not grammar.jump_forward
    assert GrammarState(grammar, TINY_VOCAB, tokenizer).forced_tokens(16) == []
    result = run_alone(model, tokenizer, request(tokenizer, grammar, max_new_tokens=200))
    assert result.finish_reason in ("eos", "length")
    if result.finish_reason == "eos":
        assert json.loads(result.text)["kind"] == "node"
