"""The decode pipeline: exact greedy output, packed engine, stop conditions, streaming, cancellation,
history, and the sampled distribution."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from reprise.engine.draft_budget import DraftBudget
from reprise.engine.engine import Engine, EngineConfig
from reprise.engine.stopping import StopChecker
from retrieval.draft_tree import DraftTree
from retrieval.registry import make_proposer
from serving.records import GenerateParams, PromptInput, Request
from verifier.runner import ModelRunner
from verifier.sampling import SamplingParams, warp_probs
from verifier.testing import chi_square, chi_square_critical, hf_greedy, tiny_model

VOCAB = 256


# ---- scripted drafters (fakes for unit tests only) -----------------------------------------------
class ScriptedSession:
    def __init__(self, owner: ScriptedProposer, prompt: list[int]) -> None:
        self.owner, self.context, self.finished = owner, list(prompt), None
        self.last: DraftTree = DraftTree.empty()
        self.accepted: list[int] = []  # accepted draft tokens the engine reported, over the request

    def propose(self, budget: int) -> DraftTree:
        self.last = self.owner.draft(self.context, budget)
        return self.last

    def commit(self, verified) -> None:
        tokens = [int(t) for t in verified.token_ids]
        # The engine maps the accepted path back to this session's own (uncut) tree.
        assert [int(self.last.token_ids[i]) for i in verified.accepted] == tokens[: verified.num_accepted]
        assert all(int(self.last.parents[node]) == (verified.accepted[k - 1] if k else -1)
                   for k, node in enumerate(verified.accepted))
        self.accepted += tokens[: verified.num_accepted]
        self.context += tokens
        self.last = DraftTree.empty()

    def finish(self, record: bool = True) -> None:
        self.finished = record


class ScriptedProposer:
    """kind: "right" (the true greedy continuation), "wrong" (random tokens), "empty", "fail" (raises)."""

    def __init__(self, model, kind: str, seed: int = 0) -> None:
        self.model, self.kind, self.rng, self.sessions = model, kind, np.random.default_rng(seed), []

    def begin(self, tenant, session_id, prompt_ids, request_id=""):
        session = ScriptedSession(self, list(prompt_ids))
        self.sessions.append(session)
        return session

    def draft(self, context: list[int], budget: int) -> DraftTree:
        if self.kind == "fail":
            raise RuntimeError("drafter exploded")
        if self.kind == "empty":
            return DraftTree.empty()
        if self.kind == "wrong":
            return DraftTree.chain(self.rng.integers(0, VOCAB, budget), probs=np.full(budget, 0.9))
        truth = hf_greedy(self.model, context, budget)
        return DraftTree.chain(truth, probs=np.full(len(truth), 0.9))


class PieceTokenizer:
    """Token i decodes to a fixed piece of text (letters, digits, a few two-letter pieces)."""

    PIECES = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)] + ["th", "er", " "]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[int(t) % len(self.PIECES)] for t in ids)


class ByteTokenizer:
    """Byte-level detokenizer for a 256-token vocabulary: token i is byte i."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(t) for t in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", vocab_size=VOCAB, seed=3)


def prompt_of(seed: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, length).tolist()


def engine_for(model, proposer, num_slots=2, tokenizer=None, **config) -> Engine:
    runner = ModelRunner(model, num_slots=num_slots, max_len=256)
    return Engine(runner, proposer, tokenizer, EngineConfig(**config))


# ---- exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", ["right", "wrong", "empty", "fail", "prompt_lookup"])
def test_greedy_output_equals_generate(family, kind) -> None:
    model = tiny_model(family, vocab_size=VOCAB, seed=4)
    proposer = make_proposer("prompt_lookup") if kind == "prompt_lookup" else ScriptedProposer(model, kind)
    engine = engine_for(model, proposer)
    for seed in range(3):
        prompt = prompt_of(seed) * 2  # repeated text gives prompt lookup something to find
        result = engine.generate(prompt, max_new_tokens=24)
        assert list(result.token_ids) == hf_greedy(model, prompt, 24, eos=True)
        assert result.finish_reason in ("length", "stop", "eos")
        assert result.usage.completion_tokens == len(result.token_ids)
        if kind != "prompt_lookup":  # the session was told exactly the accepted tokens usage counts
            assert len(proposer.sessions[-1].accepted) == result.usage.accepted_tokens
        if kind == "right":
            assert result.usage.steps < len(result.token_ids)  # drafts were accepted
        if kind in ("empty", "fail"):
            assert result.usage.steps == len(result.token_ids) and result.usage.drafted_tokens == 0


@pytest.mark.parametrize("where", ["begin", "commit", "finish"])
def test_drafter_failures_never_fail_the_request(llama, where) -> None:
    class Broken(ScriptedProposer):
        def begin(self, tenant, session_id, prompt_ids, request_id=""):
            if where == "begin":
                raise RuntimeError("no index")
            session = super().begin(tenant, session_id, prompt_ids, request_id)
            setattr(session, where, lambda *a, **k: (_ for _ in ()).throw(RuntimeError(where)))
            return session

    engine = engine_for(llama, Broken(llama, "right"))
    prompt = prompt_of(30)
    result = engine.generate(prompt, max_new_tokens=12)
    assert list(result.token_ids) == hf_greedy(llama, prompt, 12, eos=True)


def test_packed_engine_with_queue(llama) -> None:
    proposers = ScriptedProposer(llama, "right")
    engine = engine_for(llama, proposers, num_slots=3)
    prompts = [prompt_of(10 + i, 5 + 4 * i) for i in range(7)]
    handles = [
        engine.submit(Request.of_tokens(p, max_new_tokens=10 + i))
        for i, p in enumerate(prompts)
    ]
    steps = 0
    while engine.has_work:
        assert engine.step() <= 3  # never more active requests than slots
        steps += 1
    for i, (p, h) in enumerate(zip(prompts, handles)):
        assert list(h.wait().token_ids) == hf_greedy(llama, p, 10 + i, eos=True)
    assert engine.runner.num_free_slots == 3
    assert steps < sum(10 + i for i in range(7)) / 3  # packing and drafts both pay


def test_free_slots_go_to_the_tenant_holding_fewest(llama) -> None:
    """Tenant a queues 4 long requests before tenant b's one: b gets the second slot at once and the
    next slot that frees goes to whoever holds fewest, not to a's queue in arrival order."""
    engine = engine_for(llama, ScriptedProposer(llama, "empty"), num_slots=2)
    a = [engine.submit(Request.of_tokens(prompt_of(i), tenant="a", max_new_tokens=30, ignore_eos=True))
         for i in range(4)]
    b = engine.submit(Request.of_tokens(prompt_of(9), tenant="b", max_new_tokens=3, ignore_eos=True))
    engine.step()
    assert sorted(item.handle.request.tenant for item in engine._active) == ["a", "b"]
    engine.run_until_idle()
    assert b.wait().finish_reason == "length" and all(h.wait().finish_reason == "length" for h in a)


# ---- stop conditions -----------------------------------------------------------------------------
def test_stop_token_and_min_new_tokens(llama) -> None:
    prompt = prompt_of(20)
    truth = hf_greedy(llama, prompt, 30)
    stop_id = truth[4]
    engine = engine_for(llama, ScriptedProposer(llama, "right"))
    result = engine.generate(prompt, max_new_tokens=30, stop_token_ids=(stop_id,))
    cut = truth.index(stop_id)
    assert list(result.token_ids) == truth[: cut + 1]
    assert (result.finish_reason, result.matched_stop) == ("stop", stop_id)
    # min_new_tokens bans the EOS/stop ids until reached, exactly as transformers does
    engine = engine_for(llama, ScriptedProposer(llama, "right"), eos_token_ids=(stop_id,))
    result = engine.generate(prompt, max_new_tokens=30, min_new_tokens=cut + 3)
    expected = llama.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=30,
        min_new_tokens=cut + 3,
        eos_token_id=stop_id,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert list(result.token_ids) == expected
    # ignore_eos decodes through it
    result = engine.generate(prompt, max_new_tokens=30, ignore_eos=True)
    assert list(result.token_ids) == truth and result.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_text_and_tokens(llama, include) -> None:
    prompt = prompt_of(21)
    truth = hf_greedy(llama, prompt, 40)
    tok = PieceTokenizer()
    full = tok.decode(truth)
    stop = full[12:14]
    pos = full.find(stop)
    assert pos > 0
    chunks: list[tuple[list[int], str]] = []
    engine = engine_for(llama, ScriptedProposer(llama, "right"), tokenizer=tok)
    result = engine.generate(
        prompt, max_new_tokens=40, stop=(stop, "never-matches"), include_stop_str_in_output=include,
        on_stream=lambda ids, text: chunks.append((ids, text)),
    )  # fmt: skip
    assert result.finish_reason == "stop" and result.matched_stop == stop
    assert result.text == full[: pos + (len(stop) if include else 0)]
    streamed_text = "".join(t for _, t in chunks)
    assert streamed_text == result.text
    assert [i for ids, _ in chunks for i in ids] == list(result.token_ids)
    # tokens stop at the one completing the stop string
    n = len(result.token_ids)
    assert len(tok.decode(truth[:n])) >= pos + len(stop) > len(tok.decode(truth[: n - 1]))


def test_stream_holds_back_partial_utf8_and_possible_stop_prefix() -> None:
    text = "héllo wörld"
    ids = list(text.encode())
    checker = StopChecker(GenerateParams(max_new_tokens=100, stop=("wör",)), ByteTokenizer(), (), 100)
    outcomes = []
    for t in ids:
        outcomes.append(checker.append([t]))
        if outcomes[-1].finish_reason:
            break
    deltas = [o.text_delta for o in outcomes]
    assert "\ufffd" not in "".join(deltas)  # half of "é" is never streamed
    assert "".join(deltas) == checker.text == "héllo "
    assert (outcomes[-1].finish_reason, outcomes[-1].matched_stop) == ("stop", "wör")
    assert bytes(checker.token_ids).decode() == "héllo wör"  # tokens run through the one completing the stop


def test_context_limit_finishes_with_length(llama) -> None:
    engine = Engine(ModelRunner(llama, max_len=20), ScriptedProposer(llama, "right"))
    result = engine.generate(prompt_of(22, 15), max_new_tokens=50, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 5


# ---- streaming, cancellation, history -----------------------------------------------------------
def test_cancellation_frees_the_slot_and_skips_history(llama) -> None:
    proposer = ScriptedProposer(llama, "wrong")
    sink: list = []
    engine = engine_for(llama, proposer, num_slots=1, history_sink=sink.append)
    cancel = threading.Event()
    got: list[int] = []

    def on_stream(ids, text):
        got.extend(ids)
        if len(got) >= 3:
            cancel.set()

    handle = engine.submit(Request.of_tokens(prompt_of(23), max_new_tokens=50, ignore_eos=True),
                           on_stream=on_stream, cancel=cancel)
    queued = engine.submit(Request.of_tokens(prompt_of(24)))
    queued.cancel()  # cancelled while waiting: never admitted
    engine.run_until_idle()
    result = handle.wait()
    assert result.finish_reason == "aborted" and 3 <= len(result.token_ids) < 50
    assert queued.wait().finish_reason == "aborted" and queued.wait().token_ids == ()
    assert engine.runner.num_free_slots == 1
    assert proposer.sessions[0].finished is False and sink == []


def test_history_joins_through_session_and_sink(llama) -> None:
    proposer = ScriptedProposer(llama, "right")
    sink: list = []
    engine = engine_for(llama, proposer, history_sink=sink.append)
    prompt = prompt_of(25)
    request = Request.of_tokens(prompt, max_new_tokens=8, tenant="acme", session_id="s1")
    result = engine.submit(request)
    engine.run_until_idle()
    out = result.wait()
    session = proposer.sessions[0]
    assert session.finished is True and session.context == prompt + list(out.token_ids)
    assert sink == [out] and out.recorded  # the finished turn itself is what the sink stores
    assert (out.request.tenant, out.request.session_id, out.request.prompt_ids) == ("acme", "s1", tuple(prompt))


def test_bad_requests_are_rejected_with_the_value(llama) -> None:
    engine = engine_for(llama, ScriptedProposer(llama, "empty"))
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.submit(Request.of_tokens(()))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        engine.submit(Request.of_tokens((3, 4), max_new_tokens=0))
    with pytest.raises(ValueError, match="max_new_tokens is not set"):
        engine.submit(Request("default", PromptInput(token_ids=(3, 4)), prompt_ids=(3, 4)))
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens=4\], got 5"):
        engine.submit(Request.of_tokens((3, 4), max_new_tokens=4, min_new_tokens=5))
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        engine.submit(Request.of_tokens((3, 4), stop=("x",)))
    handle = engine.submit(Request.of_tokens((3, 999)))
    engine.run_until_idle()
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        handle.wait()


# ---- sampling through the whole engine ----------------------------------------------------------
def test_sampled_output_has_the_target_distribution() -> None:
    model = tiny_model("llama", vocab_size=128, seed=5, init_range=0.3)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, seed=None)
    prompt = prompt_of(26, 8)
    prompt = [t % 128 for t in prompt]

    with torch.inference_mode():
        p1 = warp_probs(model(torch.tensor([prompt])).logits[0, -1:].float(), params)[0].double()
        support = torch.nonzero(p1).flatten().tolist()
        nxt = model(torch.tensor([prompt + [x] for x in support])).logits[:, -1].float()
        p2 = warp_probs(nxt, params).double()
    exact = np.zeros((128, 128))
    for i, x in enumerate(support):
        exact[x] = (p1[x] * p2[i]).numpy()

    class Guess(ScriptedProposer):  # deterministic two-branch tree of likely tokens: accepted often
        def draft(self, context, budget):
            top = model(torch.tensor([context])).logits[0, -1].topk(2).indices.tolist()
            return DraftTree(
                np.array(top, np.int32), np.array([-1, -1], np.int32), np.array([0.5, 0.4], np.float32)
            )

    # Verify every draft node: the adaptive budget would rightly skip a 0.5/0.4 pair on the CPU cost table.
    engine = engine_for(model, Guess(model, "right"), num_slots=64, budget=DraftBudget(adaptive=False))
    handles = [
        engine.submit(Request.of_tokens(prompt, **dataclasses.asdict(params), max_new_tokens=2, ignore_eos=True))
        for _ in range(800)
    ]
    engine.run_until_idle()
    counts = np.zeros((128, 128))
    accepted = 0
    for h in handles:
        r = h.wait()
        counts[r.token_ids[0], r.token_ids[1]] += 1
        accepted += r.usage.accepted_tokens
    stat, df = chi_square(counts, exact)
    assert stat < chi_square_critical(df), stat
    assert accepted > 80  # the draft path was exercised


def test_text_of_a_request_ending_mid_character_is_flushed() -> None:
    checker = StopChecker(GenerateParams(max_new_tokens=3), ByteTokenizer(), (), 100)
    first = checker.append(list(b"ab"))
    last = checker.append(["é".encode()[0]])  # the length limit cuts a two-byte character in half
    assert first.text_delta == "ab" and last.finish_reason == "length"
    assert checker.text == "ab\ufffd" and first.text_delta + last.text_delta == checker.text
