"""The hybrid and the neural proposers in the engine: exact greedy output, the target's distribution
when sampling (with each sampled node's q), hidden states handed over, and degradation to retrieval."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from testkit.neural import VOCAB, hidden_of, random_head

from neural_drafters import proposers as neural_proposers
from neural_drafters.config import HeadConfig
from neural_drafters.drafting import DraftSettings, HeadDrafter
from neural_drafters.heads import TargetParts, build_head
from neural_drafters.hybrid import (
    HybridProposer,
    HybridSettings,
    NeuralDraftTree,
    NeuralProposer,
    ReuseProposer,
    merge_trees,
)
from neural_drafters.reuse import HiddenStateMemory
from neural_drafters.training import Example, Trainer, TrainSettings, extract_features
from reprise import drafters
from reprise.engine.draft_budget import DraftBudget
from reprise.engine.engine import Engine, EngineConfig
from retrieval.config import DraftingConfig
from retrieval.draft_tree import DraftTree
from retrieval.registry import make_proposer
from serving.records import Request
from verifier.runner import ModelRunner
from verifier.sampling import SamplingParams, warp_probs
from verifier.testing import chi_square, chi_square_critical, hf_greedy


def prompt(seed: int, n: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def neural(target, kind="eagle", mode="topk", seed=0, **kw) -> NeuralProposer:
    head, parts = random_head(target, kind, num_heads=1 if kind == "eagle" else 3, seed=seed, std=0.15, **kw)
    return NeuralProposer(HeadDrafter(head, parts, DraftSettings(top_k=3, depth=4, mode=mode, seed=seed)))


def hybrid(target, threshold=2.0, mode="merge") -> HybridProposer:
    return HybridProposer(make_proposer("prompt_lookup"), neural(target), ReuseProposer(HiddenStateMemory()),
                          HybridSettings(threshold=threshold, mode=mode))


def engine(model, proposer, slots=2, adaptive=True) -> Engine:
    config = EngineConfig(budget=DraftBudget(adaptive=adaptive))  # adaptive=False: verify every node drafted
    return Engine(ModelRunner(model, num_slots=slots, max_len=256, max_draft_nodes=32), proposer, None, config)


# ---- tree merging -----------------------------------------------------------------------------------
def tree(tokens, parents, probs, source) -> DraftTree:
    return DraftTree(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(probs, np.float32), 0.0,
                     source)


def test_merge_shares_equal_paths_and_respects_budget_and_priority() -> None:
    a = tree([1, 2, 3], [-1, 0, 1], [1.0, 1.0, 1.0], "suffix")
    b = tree([1, 2, 9, 4], [-1, 0, 1, -1], [0.5, 0.9, 0.4, 0.3], "neural")
    merged = merge_trees([a, b], 5)  # b's nodes come best first: 4 (path 0.3) before 9 (1 x 1 x 0.4 ... 0.18 in b)
    assert merged.token_ids.tolist() == [1, 2, 3, 4, 9] and merged.parents.tolist() == [-1, 0, 1, -1, 1]
    assert merged.probs.tolist()[:2] == [1.0, 1.0] and merged.source == "suffix+neural"
    assert abs(merged.score - (3 + 0.3 + 0.4)) < 1e-5
    cut = merge_trees([b, a], 3)  # priority to b, its best three nodes; a's 3 does not fit
    assert cut.token_ids.tolist() == [1, 2, 4] and cut.parents.tolist() == [-1, 0, -1]
    path_stored = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32), np.array([0.8, 0.4], np.float32),
                            1.2, "suffix")  # the suffix index stores path probabilities (score = their sum)
    assert np.allclose(merge_trees([path_stored], 4).probs, [0.8, 0.5])  # merged trees are conditional
    assert len(merge_trees([DraftTree.empty(), DraftTree.empty()], 8)) == 0


# ---- exactness in the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle", "medusa", "mtp"])
def test_greedy_output_with_neural_drafts_equals_generate(target, kind) -> None:
    proposer = neural(target, kind, draft_vocab=96 if kind == "eagle" else None)
    eng = engine(target, proposer)
    for seed in range(3):
        p = prompt(seed)
        result = eng.generate(p, max_new_tokens=24, ignore_eos=True)
        assert list(result.token_ids) == hf_greedy(target, p, 24), seed
    assert eng.runner.keep_hidden  # the engine turned hidden states on for this proposer


@pytest.mark.parametrize("mode", ["merge", "switch"])
def test_greedy_output_with_hybrid_drafts_equals_generate(target, mode) -> None:
    eng = engine(target, hybrid(target, threshold=3.0, mode=mode))
    base = prompt(10)
    accepted = 0
    for i in range(4):  # later requests repeat earlier ones: history and reuse have something to say
        p = base + prompt(20 + i % 2, 4)
        result = eng.generate(p, tenant="acme", max_new_tokens=20, ignore_eos=True)
        assert list(result.token_ids) == hf_greedy(target, p, 20), i
        accepted += result.usage.accepted_tokens
    assert accepted > 0


def test_engine_hands_the_states_of_committed_positions(target) -> None:
    seen: list[torch.Tensor] = []

    class Recording(NeuralProposer):
        def begin(self, tenant, session_id, prompt_ids, request_id=""):
            session = super().begin(tenant, session_id, prompt_ids, request_id)
            original = session.observe_hidden

            def observe(states):
                seen.append(states.detach().clone())
                original(states)

            session.observe_hidden = observe
            return session

    p = prompt(30)
    base = neural(target)
    eng = engine(target, Recording(base.drafter))
    out = list(eng.generate(p, max_new_tokens=10, ignore_eos=True).token_ids)
    got = torch.cat(seen)
    expected = hidden_of(target, p + out)[: len(p) + len(out) - 1]
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-4)


def sampled_joint(model, params, first_prompt, proposer, trials):
    with torch.inference_mode():
        p1 = warp_probs(model(torch.tensor([first_prompt])).logits[0, -1:].float(), params)[0].double()
        support = torch.nonzero(p1).flatten().tolist()
        nxt = model(torch.tensor([first_prompt + [x] for x in support])).logits[:, -1].float()
        p2 = warp_probs(nxt, params).double()
    exact = np.zeros((VOCAB, VOCAB))
    for i, x in enumerate(support):
        exact[x] = (p1[x] * p2[i]).numpy()
    eng = engine(model, proposer, slots=64, adaptive=False)
    verified_with_q = []
    original = eng.runner.verify

    def verify(steps):
        verified_with_q.extend(s.q is not None for s in steps)
        return original(steps)

    eng.runner.verify = verify
    handles = [eng.submit(Request.of_tokens(first_prompt, **dataclasses.asdict(params), max_new_tokens=2, ignore_eos=True))
               for _ in range(trials)]
    eng.run_until_idle()
    counts = np.zeros((VOCAB, VOCAB))
    accepted = 0
    for h in handles:
        r = h.wait()
        counts[r.token_ids[0], r.token_ids[1]] += 1
        accepted += r.usage.accepted_tokens
    return counts, exact, accepted, verified_with_q


@pytest.fixture(scope="module")
def trained_eagle(target):
    """An EAGLE head trained briefly on the target's own greedy continuations: its drafts are often
    right, so acceptance paths are exercised."""
    examples = []
    for seed in range(6):
        p = prompt(100 + seed, 6)
        ids = p + hf_greedy(target, p, 40)
        examples.append(Example(np.array(ids, np.int32), np.arange(len(ids)) >= 5))
    torch.manual_seed(0)
    head = build_head(HeadConfig.for_target(target.config, "eagle"))
    trainer = Trainer(head, TargetParts.from_model(target, head.d2t), extract_features(target, examples),
                      TrainSettings(steps=50, batch_size=4, seq_len=24, lr=4e-3, warmup=4))
    for _ in range(50):
        trainer.train_step()
    return head, trainer.parts


@pytest.mark.parametrize("mode", ["sample", pytest.param("topk", marks=pytest.mark.slow)])
def test_sampling_keeps_the_target_distribution(target, trained_eagle, mode) -> None:
    params = SamplingParams(temperature=0.9, top_k=6)
    head, parts = trained_eagle
    settings = DraftSettings(top_k=2, depth=2, mode=mode, width=2, temperature=1.0, seed=1)
    proposer = NeuralProposer(HeadDrafter(head, parts, settings))
    counts, exact, accepted, with_q = sampled_joint(target, params, prompt(100, 6), proposer, 600)
    stat, df = chi_square(counts, exact)
    assert stat < chi_square_critical(df), stat
    assert accepted > 50  # drafts were exercised
    if mode == "sample":
        assert sum(with_q) > 100  # the sampled nodes' q reached the verifier
    else:
        assert not any(with_q)


def test_sampled_drafts_carry_q_rows_over_the_full_vocabulary(target) -> None:
    proposer = neural(target, mode="sample", draft_vocab=64)
    session = proposer.begin("t", "s", prompt(50))
    session.observe_hidden(hidden_of(target, prompt(50))[:11])
    draft = session.propose(8)
    assert isinstance(draft, NeuralDraftTree) and draft.q.shape == (len(draft), VOCAB)
    assert torch.allclose(draft.q.sum(-1), torch.ones(len(draft)), atol=1e-5)
    assert all(float(draft.q[i, t]) > 0 for i, t in enumerate(draft.token_ids.tolist()))


# ---- degradation ---------------------------------------------------------------------------------------
def test_missing_checkpoint_degrades_to_retrieval_with_a_warning(tmp_path, monkeypatch, caplog, target) -> None:
    monkeypatch.setenv(neural_proposers.CHECKPOINT_ENV, str(tmp_path / "none"))
    with caplog.at_level(logging.WARNING):
        proposer = neural_proposers.make_hybrid_proposer(None)
        nothing = neural_proposers.make_neural_proposer(None)
    assert proposer.neural is None
    assert "no neural drafter" in caplog.text and "does not exist" in caplog.text
    assert len(nothing.begin("t", "s", [1, 2]).propose(8)) == 0
    p = prompt(60, 6) * 3
    result = engine(target, proposer).generate(p, max_new_tokens=12, ignore_eos=True)
    assert list(result.token_ids) == hf_greedy(target, p, 12)


def test_failing_head_is_dropped_once_and_drafting_continues(target, caplog) -> None:
    proposer = hybrid(target, threshold=100.0)

    def explode(budget):
        raise RuntimeError("head exploded")

    proposer.neural.drafter.start = lambda ids, _start=proposer.neural.drafter.start: _fail(_start(ids), explode)
    p = prompt(70, 6) * 3
    with caplog.at_level(logging.WARNING):
        result = engine(target, proposer).generate(p, max_new_tokens=12, ignore_eos=True)
    assert list(result.token_ids) == hf_greedy(target, p, 12)
    assert caplog.text.count("head exploded") == 1
    assert result.usage.drafted_tokens > 0  # prompt lookup kept drafting


def _fail(request, propose):
    request.propose = propose
    return request


def test_without_hidden_states_the_hybrid_is_retrieval(target, caplog) -> None:
    proposer = hybrid(target, threshold=100.0)
    session = proposer.begin("t", "s", [1, 2, 3, 1, 2])
    with caplog.at_level(logging.WARNING):
        draft = session.propose(8)
    assert draft.source == "prompt_lookup" and draft.token_ids.tolist() == [3, 1, 2]
    assert "no hidden states" in caplog.text
    with pytest.raises(ValueError, match="unknown hybrid mode 'blend'"):
        HybridSettings(mode="blend")


def test_registry_names_resolve(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(neural_proposers.CHECKPOINT_ENV, str(tmp_path / "none"))
    assert {"neural", "hidden_reuse", "hybrid", "reprise"} <= set(drafters.proposer_names())
    assert isinstance(drafters.make_proposer("hidden_reuse"), ReuseProposer)
    assert isinstance(drafters.make_proposer("hybrid"), HybridProposer)
    assert all(drafters.describe_proposers().values())


def test_a_tenants_own_threshold_overrides_the_proposers(target) -> None:
    retrieval = make_proposer("reprise")
    proposer = HybridProposer(retrieval, neural(target), ReuseProposer(HiddenStateMemory()),
                              HybridSettings(threshold=2.0))
    retrieval.set_tenant_config("tuned", DraftingConfig(hybrid_threshold=0.0))  # never consults the head
    assert proposer.begin("tuned", "s", prompt(1)).threshold == 0.0
    assert proposer.begin("other", "s", prompt(1)).threshold == 2.0
    session = proposer.begin("tuned", "s2", prompt(2))
    session.observe_hidden(hidden_of(target, prompt(2))[:-1])
    session.propose(8)
    assert "neural" not in session.steps_by_source and "merged" not in session.steps_by_source
    with pytest.raises(ValueError, match="hybrid_threshold must be >= 0"):
        DraftingConfig(hybrid_threshold=-1.0)
