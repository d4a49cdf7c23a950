"""The model runner: tree logits, greedy exactness, compaction, packing, hidden states, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.draft_tree import DraftTree
from verifier.kernels import triton_available
from verifier.runner import ModelRunner, VerifyStep
from verifier.testing import FAMILIES, full_logits, hf_greedy, random_tree, tiny_model

VOCAB = 256


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param, vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", vocab_size=VOCAB, seed=2)


def prompt_of(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, length).tolist()


def branching_tree(truth: list[int]) -> DraftTree:
    """Right path at nodes 1 and 3 (children of wrong siblings' order), so compaction must move rows."""
    wrong = [(t + 7) % VOCAB for t in truth]
    tokens = [wrong[0], truth[0], wrong[1], truth[1], wrong[2]]
    parents = [-1, -1, 0, 1, 3]
    return DraftTree(np.array(tokens, np.int32), np.array(parents, np.int32), np.ones(5, np.float32))


@pytest.mark.parametrize("backend", ["torch", "model"])
def test_tree_logits_equal_sequential(model, backend) -> None:
    prompt = prompt_of(0, 11)
    runner = ModelRunner(model, max_len=64, backend=backend)
    slot = runner.start(prompt)
    tree = random_tree(np.random.default_rng(0), hf_greedy(model, prompt, 6), 12, VOCAB, 0.5)
    (logits,) = runner.score([VerifyStep(slot, tree)])
    parents = tree.parents.tolist()
    for row in range(1 + len(tree)):
        path, node = [], row - 1
        while node >= 0:
            path.append(int(tree.token_ids[node]))
            node = parents[node]
        expected = full_logits(model, prompt + path[::-1])[-1]
        assert torch.allclose(logits[row], expected, atol=1e-4), (row, (logits[row] - expected).abs().max())


@pytest.mark.parametrize("backend", ["torch", "model"])
def test_compacted_cache_equals_fresh_prefill(model, backend) -> None:
    prompt = prompt_of(1, 9)
    truth = hf_greedy(model, prompt, 4)
    runner = ModelRunner(model, num_slots=2, max_len=64, backend=backend)
    slot = runner.start(prompt)
    (result,) = runner.verify([VerifyStep(slot, branching_tree(truth))])
    assert result.accepted.tolist() == [1, 3] and result.token_ids.tolist() == truth[:3]
    context = runner.context_ids(slot)
    fresh = runner.start(context)  # prefills context[:-1], exactly the rows the first slot now caches
    keys, values = runner.pool.slot_view(slot, len(context) - 1)
    fresh_keys, fresh_values = runner.pool.slot_view(fresh, len(context) - 1)
    assert torch.allclose(keys, fresh_keys, atol=1e-5) and torch.allclose(values, fresh_values, atol=1e-5)


def test_packed_verify_equals_one_by_one(model) -> None:
    prompts = [prompt_of(s, n) for s, n in [(2, 5), (3, 17), (4, 30)]]
    rng = np.random.default_rng(5)
    trees = [random_tree(rng, hf_greedy(model, p, 8), n, VOCAB, 0.8) for p, n in zip(prompts, [9, 0, 4])]
    packed = ModelRunner(model, num_slots=3, max_len=64)
    packed.pool.kv.fill_(float("nan"))  # garbage in never-written rows must not leak into attention
    slots = [packed.start(p) for p in prompts]
    slots = [slots[2], slots[0], slots[1]]  # non-consecutive order exercises the gathered cache view
    order = [2, 0, 1]
    together = packed.verify([VerifyStep(s, trees[i]) for s, i in zip(slots, order)])
    for result, i in zip(together, order):
        alone = ModelRunner(model, max_len=64)
        (single,) = alone.verify([VerifyStep(alone.start(prompts[i]), trees[i])])
        assert result.token_ids.tolist() == single.token_ids.tolist()
        assert result.accepted.tolist() == single.accepted.tolist()
    # and the packed caches keep decoding correctly
    for _ in range(3):
        packed.verify([VerifyStep(s, DraftTree.empty()) for s in slots])
    for s, i in zip(slots, order):
        context = packed.context_ids(s)
        assert context[len(prompts[i]) :] == hf_greedy(model, prompts[i], len(context) - len(prompts[i]))


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    p_right=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    max_nodes=st.sampled_from([0, 4, 24]),
)
def test_greedy_equals_generate_with_random_trees(model, seed, p_right, max_nodes) -> None:
    rng = np.random.default_rng(seed)
    prompt = prompt_of(seed, int(rng.integers(1, 20)))
    num_tokens = 20
    truth = hf_greedy(model, prompt, num_tokens + 30)
    runner = ModelRunner(model, max_len=128, backend="torch" if seed % 2 else "model")
    slot = runner.start(prompt)
    out: list[int] = []
    while len(out) < num_tokens:
        n = int(rng.integers(0, max_nodes + 1))
        tree = random_tree(rng, truth[len(out) :], n, VOCAB, p_right)
        (result,) = runner.verify([VerifyStep(slot, tree)])
        assert 1 <= len(result.token_ids) == len(result.accepted) + 1
        out += result.token_ids.tolist()
    assert out[:num_tokens] == truth[:num_tokens]


def test_right_drafts_accept_everything(llama) -> None:
    prompt = prompt_of(6, 8)
    truth = hf_greedy(llama, prompt, 12)
    runner = ModelRunner(llama, max_len=64)
    slot = runner.start(prompt)
    (result,) = runner.verify([VerifyStep(slot, DraftTree.chain(truth[:10]))])
    assert result.accepted.tolist() == list(range(10))
    assert result.token_ids.tolist() == truth[:11]


def test_hidden_states_of_committed_rows(llama) -> None:
    prompt = prompt_of(7, 10)
    truth = hf_greedy(llama, prompt, 4)
    runner = ModelRunner(llama, max_len=64, keep_hidden=True)
    slot = runner.start(prompt)
    (result,) = runner.verify([VerifyStep(slot, branching_tree(truth))])
    with torch.inference_mode():
        top = llama.base_model(torch.tensor([runner.context_ids(slot)])).last_hidden_state[0]
    rows = np.arange(len(prompt) - 1, len(prompt) - 1 + len(result.token_ids))  # root, then accepted nodes
    assert result.hidden_states.shape == (3, 64)
    assert torch.allclose(result.hidden_states, top[rows], atol=1e-5)
    plain = ModelRunner(llama, max_len=64)
    (res,) = plain.verify([VerifyStep(plain.start(prompt), DraftTree.empty())])
    assert res.hidden_states is None


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_backend_in_a_model(llama) -> None:
    """The Triton kernels inside a real forward pass (interpreted on CPU: small shapes only)."""
    prompt = prompt_of(8, 6)
    truth = hf_greedy(llama, prompt, 6)
    runner = ModelRunner(llama, max_len=32, backend="triton")
    slot = runner.start(prompt)
    out = runner.verify([VerifyStep(slot, branching_tree(truth))])[0].token_ids.tolist()
    out += runner.verify([VerifyStep(slot, DraftTree.chain(truth[3:5]))])[0].token_ids.tolist()
    assert out == truth[: len(out)] and len(out) == 6


def test_slots_are_reused_and_errors_name_the_value(llama) -> None:
    runner = ModelRunner(llama, num_slots=2, max_len=16, max_draft_nodes=4)
    a = runner.start([3, 4, 5])
    b = runner.start([6])
    with pytest.raises(RuntimeError, match="no free slot: all 2"):
        runner.start([7])
    runner.release(b)
    runner.release(b)  # releasing twice is harmless
    assert runner.num_free_slots == 1
    with pytest.raises(ValueError, match="slot 7 is not an active request"):
        runner.verify([VerifyStep(7, DraftTree.empty())])
    with pytest.raises(ValueError, match="appears twice"):
        runner.verify([VerifyStep(a, DraftTree.empty()), VerifyStep(a, DraftTree.empty())])
    with pytest.raises(ValueError, match="tree has 5 nodes, max_draft_nodes is 4"):
        runner.verify([VerifyStep(a, DraftTree.chain([1, 2, 3, 4, 5]))])
    with pytest.raises(ValueError, match="draft token id 999 is outside"):
        runner.verify([VerifyStep(a, DraftTree.chain([999]))])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        runner.start([])
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        runner.start([1, 256])
    with pytest.raises(ValueError, match="prompt has 16 tokens; this runner's max_len is 16"):
        runner.start(list(range(16)))
    while runner.remaining(a) >= 4:
        runner.verify([VerifyStep(a, DraftTree.empty())])
    with pytest.raises(ValueError, match="exceed max_len 16"):
        runner.verify([VerifyStep(a, DraftTree.chain([1, 2, 3]))])
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        ModelRunner(llama, backend="cuda")
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        ModelRunner(llama, num_slots=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs a CUDA GPU and triton")
def test_cuda_runner_with_triton_kernels_matches_generate() -> None:
    model = tiny_model("llama", vocab_size=VOCAB, seed=11).cuda()
    prompts = [prompt_of(40 + i, 9 + 13 * i) for i in range(3)]
    runner = ModelRunner(model, num_slots=3, max_len=128)  # auto: Triton kernels on CUDA
    assert runner.backend == "triton"
    slots = [runner.start(p) for p in prompts]
    truths = [hf_greedy(model, p, 40) for p in prompts]
    rng = np.random.default_rng(0)
    outs: list[list[int]] = [[] for _ in prompts]
    while min(len(o) for o in outs) < 24:
        steps = [VerifyStep(s, random_tree(rng, t[len(o) :], 16, VOCAB, 0.8)) for s, t, o in zip(slots, truths, outs)]
        for o, result in zip(outs, runner.verify(steps)):
            o += result.token_ids.tolist()
    for o, t in zip(outs, truths):
        assert o[:24] == t[:24]


@pytest.mark.parametrize("family", FAMILIES)
def test_model_stays_a_correct_plain_model_after_the_runner_switched_it(family) -> None:
    """The runner registers its attention on the model; transformers' own multi-token calls (prompt
    lookup verifies 10 tokens at once) must still get a causal mask and the same output."""
    model = tiny_model(family, vocab_size=VOCAB, seed=12)
    prompt = prompt_of(50, 20) * 2
    before = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=10,
                            pad_token_id=0, eos_token_id=None)  # fmt: skip
    ModelRunner(model, max_len=64)
    after = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=10,
                           pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert after.tolist() == before.tolist()
    assert after[0, len(prompt) :].tolist() == hf_greedy(model, prompt, 16)


@pytest.mark.parametrize("cache_bytes", [1 << 20, 0], ids=["rows-cached", "rows-recomputed"])
def test_a_parked_request_resumes_with_its_rows_context_and_generator(llama, cache_bytes) -> None:
    """``park`` then ``resume`` (in another slot, another request between): the slot holds the same KV
    rows (cached blocks copied back, the rest prefilled), the same context and prompt length, and the
    generator draws on where it was."""
    from verifier.sampling import SamplingParams

    prompt = prompt_of(3, 21)
    runner = ModelRunner(llama, num_slots=2, max_len=96, prefix_cache_bytes=cache_bytes, prefix_block_size=4)
    slot = runner.start(prompt, SamplingParams(temperature=0.9, seed=5), cache_scope="a", publish=True)
    rng = np.random.default_rng(0)
    for _ in range(4):
        tree = random_tree(rng, hf_greedy(llama, runner.context_ids(slot), 5), 6, VOCAB, 0.6)
        runner.verify([VerifyStep(slot, tree)])
    context = runner.context_ids(slot)
    keys, values = (t.clone() for t in runner.pool.slot_view(slot, len(context) - 1))
    parked = runner.park(slot)
    expected = torch.rand(3, generator=torch.Generator().set_state(parked.generator_state))
    other = runner.start(prompt_of(4, 30))  # takes the freed slot and overwrites its rows
    resumed = runner.resume(parked)
    assert resumed != slot and other == slot
    assert runner.context_ids(resumed) == context and runner._state(resumed).num_prompt == len(prompt)
    new_keys, new_values = runner.pool.slot_view(resumed, len(context) - 1)
    assert torch.allclose(keys, new_keys, atol=1e-5) and torch.allclose(values, new_values, atol=1e-5)
    assert torch.equal(torch.rand(3, generator=runner._state(resumed).generator), expected)
