"""The engine over a runner with a prefix cache: agent calls reuse their tenant's KV (usage says how
much), packed steps mix reused and fresh requests, outputs stay generate's, and requests that failed
or asked not to be recorded leave nothing behind."""

from __future__ import annotations

import numpy as np

from reprise.engine.engine import Engine
from retrieval.registry import make_proposer
from serving.records import Request
from verifier.runner import ModelRunner
from verifier.testing import hf_greedy, tiny_model

VOCAB = 256


def make_engine(num_slots: int = 3, drafter: str = "prompt_lookup") -> Engine:
    model = tiny_model("llama", vocab_size=VOCAB, seed=4)
    runner = ModelRunner(model, num_slots=num_slots, max_len=256, max_draft_nodes=16,
                         prefix_cache_bytes=1 << 24, prefix_block_size=8)  # fmt: skip
    return Engine(runner, make_proposer(drafter), None)


def words(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, n).tolist()


def test_agent_calls_reuse_the_last_calls_prompt_and_output() -> None:
    engine = make_engine()
    model = engine.runner.model
    prompt = words(0, 30)
    cached = []
    for call in range(3):
        result = engine.generate(prompt, tenant="agent", max_new_tokens=10, ignore_eos=True)
        assert list(result.token_ids) == hf_greedy(model, prompt, 10)
        cached.append(result.usage.cached_tokens)
        prompt = prompt + list(result.token_ids) + words(10 + call, 7)  # the next call extends this one
    assert cached[0] == 0
    assert cached[1] == (30 + 10 - 1) // 8 * 8 and cached[2] >= cached[1] + 16


def test_packed_requests_from_cache_and_from_scratch() -> None:
    engine = make_engine(num_slots=3)
    model = engine.runner.model
    base = words(1, 40)
    engine.generate(base, tenant="a", max_new_tokens=4, ignore_eos=True)
    prompts = [base + words(2, 5), words(3, 25), base + words(4, 11)]
    handles = [
        engine.submit(Request.of_tokens(p, tenant=t, max_new_tokens=16, ignore_eos=True))
        for p, t in zip(prompts, ["a", "b", "a"])
    ]
    engine.run_until_idle()
    results = [h.wait() for h in handles]
    assert [r.usage.cached_tokens for r in results] == [40, 0, 40]
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == hf_greedy(model, prompt, 16)


def test_unrecorded_and_failed_requests_leave_no_kv() -> None:
    engine = make_engine()
    prompt = words(5, 33)
    handle = engine.submit(Request.of_tokens(prompt, max_new_tokens=3, tenant="a", record=False))
    engine.run_until_idle()
    handle.wait()
    assert engine.runner.prefix_cache.stats().num_blocks == 0
    original = engine.runner.verify

    def broken(steps):
        raise RuntimeError("device lost")

    engine.runner.verify = broken
    failed = engine.submit(Request.of_tokens(prompt, tenant="a"))
    engine.step()
    assert failed.done.is_set() and failed.error is not None
    assert engine.runner.prefix_cache.stats().num_blocks == 0
    engine.runner.verify = original
    assert engine.generate(prompt, tenant="a", max_new_tokens=2).usage.cached_tokens == 0
    assert engine.generate(prompt, tenant="a", max_new_tokens=2).usage.cached_tokens == 32
    assert engine.forget_tenant("a") > 0
    assert engine.generate(prompt, tenant="a", max_new_tokens=2).usage.cached_tokens == 0


def test_parallel_calls_of_a_tenant_prefill_their_shared_prompt_once() -> None:
    """An agent's parallel trials (or a fan-out) of one tenant sent at once: the first prefills the
    shared prompt and publishes it, the others start from it while it still runs; another tenant's
    request with the same prompt prefills its own; outputs stay generate's."""
    engine = make_engine(num_slots=4)
    model = engine.runner.model
    shared = words(20, 48)
    prompts = [shared + words(21 + i, 3) for i in range(3)] + [shared]
    tenants = ["a", "a", "a", "b"]
    handles = [engine.submit(Request.of_tokens(p, tenant=t, max_new_tokens=12, ignore_eos=True))
               for p, t in zip(prompts, tenants)]
    engine.run_until_idle()
    results = [h.wait() for h in handles]
    assert [r.usage.cached_tokens for r in results] == [0, 48, 48, 0]
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == hf_greedy(model, prompt, 12)
