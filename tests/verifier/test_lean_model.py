"""The lean Llama/Qwen2 forward: the same logits as transformers' forward, greedy outputs equal to
``generate`` with random trees, packing and prefix reuse; other families stay on transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.draft_tree import DraftTree
from verifier.lean_model import supports_lean
from verifier.runner import ModelRunner, VerifyStep
from verifier.testing import hf_greedy, random_tree, tiny_model

VOCAB = 256
LEAN_FAMILIES = ("llama", "qwen2")


@pytest.fixture(scope="module", params=LEAN_FAMILIES)
def model(request):
    return tiny_model(request.param, vocab_size=VOCAB, seed=3)


def prompt_of(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, length).tolist()


def test_auto_picks_lean_for_llama_and_qwen2_only() -> None:
    for family in ("llama", "qwen2"):
        assert ModelRunner(tiny_model(family, vocab_size=VOCAB), max_len=32).forward_kind == "lean"
    gpt2 = tiny_model("gpt2", vocab_size=VOCAB)
    assert not supports_lean(gpt2)
    assert ModelRunner(gpt2, max_len=32).forward_kind == "transformers"
    with pytest.raises(ValueError, match="lean"):
        ModelRunner(gpt2, max_len=32, forward="lean")
    with pytest.raises(ValueError, match="unknown forward"):
        ModelRunner(gpt2, max_len=32, forward="fast")


def test_tree_logits_equal_the_transformers_forward(model) -> None:
    prompt = prompt_of(0, 40)
    tree = random_tree(np.random.default_rng(1), hf_greedy(model, prompt, 6), 14, VOCAB, 0.5)
    logits = {}
    for forward in ("lean", "transformers"):
        runner = ModelRunner(model, max_len=128, forward=forward, prefill_chunk=16)  # chunks past position 0
        slot = runner.start(prompt)
        runner.verify([VerifyStep(slot, DraftTree.empty())])  # an unmasked plain step first
        (logits[forward],) = runner.score([VerifyStep(slot, tree)])
    assert torch.allclose(logits["lean"], logits["transformers"], atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    p_right=st.sampled_from([0.0, 0.5, 1.0]),
    max_nodes=st.sampled_from([0, 3, 24]),
)
def test_greedy_equals_generate_with_random_trees(model, seed, p_right, max_nodes) -> None:
    rng = np.random.default_rng(seed)
    prompt = prompt_of(seed, int(rng.integers(1, 40)))
    truth = hf_greedy(model, prompt, 50)
    runner = ModelRunner(model, max_len=128, forward="lean", prefill_chunk=int(rng.integers(1, 20)))
    slot = runner.start(prompt)
    out: list[int] = []
    while len(out) < 20:
        tree = random_tree(rng, truth[len(out) :], int(rng.integers(0, max_nodes + 1)), VOCAB, p_right)
        (result,) = runner.verify([VerifyStep(slot, tree)])
        out += result.token_ids.tolist()
    assert out[:20] == truth[:20]


def test_packed_requests_of_different_lengths_in_any_slot_order(model) -> None:
    prompts = [prompt_of(s, n) for s, n in [(2, 5), (3, 17), (4, 30), (5, 17)]]
    runner = ModelRunner(model, num_slots=4, max_len=96, forward="lean")
    runner.pool.kv.fill_(float("nan"))  # never-written rows must not leak into attention
    slots = [runner.start(p) for p in prompts]
    order = [2, 0, 3, 1]  # non-consecutive slots: the gathered path
    rng = np.random.default_rng(6)
    truths = [hf_greedy(model, p, 40) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for step in range(12):
        steps = []
        for i in order:
            nodes = 0 if step % 3 == 0 else int(rng.integers(0, 8))  # plain packed steps too
            steps.append(VerifyStep(slots[i], random_tree(rng, truths[i][len(outs[i]) :], nodes, VOCAB, 0.7)))
        for i, result in zip(order, runner.verify(steps)):
            outs[i] += result.token_ids.tolist()
    for i, prompt in enumerate(prompts):
        assert outs[i] == truths[i][: len(outs[i])], i
    # Two requests of the same length in consecutive slots: one plain step needs no mask at all.
    same = ModelRunner(model, num_slots=2, max_len=64, forward="lean")
    a, b = same.start(prompts[1]), same.start(prompts[3])
    results = same.verify([VerifyStep(a, DraftTree.empty()), VerifyStep(b, DraftTree.empty())])
    assert [r.token_ids.tolist() for r in results] == [truths[1][:1], truths[3][:1]]


def test_prefix_cache_hits_decode_as_generate(model) -> None:
    runner = ModelRunner(model, max_len=128, forward="lean", prefix_cache_bytes=1 << 20, prefix_block_size=4)
    first = prompt_of(8, 30)
    slot = runner.start(first, cache_scope="t")
    for _ in range(5):
        runner.verify([VerifyStep(slot, DraftTree.empty())])
    context = runner.context_ids(slot)
    runner.release(slot)
    second = context + prompt_of(9, 7)
    slot = runner.start(second, cache_scope="t")
    assert runner.num_reused(slot) > 0
    truth = hf_greedy(model, second, 10)
    out: list[int] = []
    rng = np.random.default_rng(10)
    while len(out) < 10:
        (result,) = runner.verify([VerifyStep(slot, random_tree(rng, truth[len(out) :], 5, VOCAB, 0.6))])
        out += result.token_ids.tolist()
    assert out[:10] == truth


def test_runners_of_one_model_share_its_packed_weights() -> None:
    model = tiny_model("llama", vocab_size=VOCAB, seed=4)
    a, b = ModelRunner(model, max_len=32), ModelRunner(model, max_len=32, num_slots=2)
    assert a._lean is b._lean is not None
    assert ModelRunner(tiny_model("llama", vocab_size=VOCAB, seed=4), max_len=32)._lean is not a._lean


def test_bfloat16_logits_match_the_transformers_forward(model) -> None:
    """In bfloat16 the lean forward packs its weights for oneDNN where the CPU has bfloat16 kernels
    (another reduction order than ``F.linear``): logits agree to bfloat16's precision, not bit for bit."""
    bf16 = tiny_model(model.config.model_type, vocab_size=VOCAB, seed=3).to(torch.bfloat16)
    prompt = prompt_of(2, 40)
    tree = random_tree(np.random.default_rng(4), hf_greedy(model, prompt, 6), 14, VOCAB, 0.5)
    logits = {}
    for forward in ("lean", "transformers"):
        runner = ModelRunner(bf16, max_len=128, forward=forward, prefill_chunk=16)
        slot = runner.start(prompt)
        runner.verify([VerifyStep(slot, DraftTree.empty())])
        (logits[forward],) = runner.score([VerifyStep(slot, tree)])
    scale = logits["transformers"].abs().max()
    assert (logits["lean"] - logits["transformers"]).abs().max() <= 0.05 * scale
