"""The tenant-scoped prefix cache: its blocks and chains alone, then inside the runner (exact KV, greedy
outputs unchanged, packed steps, tenant scope, the memory budget, dropping a tenant)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.draft_tree import DraftTree
from verifier.prefix_cache import PrefixCache
from verifier.runner import ModelRunner, VerifyStep
from verifier.testing import FAMILIES, hf_greedy, random_tree, tiny_model

VOCAB = 256
BS = 4  # tokens per block in these tests


def prompt_of(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, length).tolist()


# ---- the cache alone, over a hand-filled pool --------------------------------------------------------


def small_cache(num_blocks: int) -> tuple[PrefixCache, torch.Tensor]:
    """A cache of ``num_blocks`` blocks, and a pool ``[2, L=2, S=3, H=1, R=64, D=2]`` whose row r of slot
    s holds the value ``1000 * s + r`` everywhere (so copies can be read back)."""
    cache = PrefixCache(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
                        capacity_bytes=num_blocks * 2 * 2 * 1 * BS * 2 * 4, block_size=BS)  # fmt: skip
    kv = torch.zeros(2, 2, 3, 1, 64, 2)
    for s in range(3):
        kv[:, :, s] = (1000 * s + torch.arange(64.0))[None, None, None, :, None]
    return cache, kv


def test_blocks_round_trip_and_share_a_prefix() -> None:
    cache, kv = small_cache(8)
    tokens = list(range(10, 21))  # 11 tokens: two whole blocks
    lease = cache.match("a", tokens)
    assert lease.num_blocks == 0
    assert cache.insert(lease, tokens, kv, slot=1) == 2
    cache.check_integrity()
    lease = cache.match("a", tokens + [99, 98])
    assert lease.num_blocks == 2
    dest = torch.zeros_like(kv)
    assert cache.load(lease, dest, slot=2) == 8
    assert torch.equal(dest[:, :, 2, :, :8], kv[:, :, 1, :, :8])  # slot 1's rows, now in slot 2
    assert dest[:, :, 2, :, 8:].abs().sum() == 0
    # A longer sequence through the same prefix shares the two blocks and adds one.
    assert cache.insert(lease, tokens + [99, 98], kv, slot=2) == 1
    cache.check_integrity()
    assert cache.stats().num_blocks == 3
    assert cache.match("a", tokens[:7]).num_blocks == 1  # whole blocks only


def test_scopes_never_meet() -> None:
    cache, kv = small_cache(8)
    tokens = list(range(30, 42))
    cache.insert(cache.match("tenant-a", tokens), tokens, kv, slot=0)
    assert cache.match("tenant-a", tokens).num_blocks == 3
    assert cache.match("tenant-b", tokens).num_blocks == 0
    assert cache.scope_stats("tenant-b").hit_tokens == 0
    assert cache.scope_stats("tenant-a").hit_tokens == 12


def test_lru_evicts_leaves_first_and_never_a_pinned_block() -> None:
    cache, kv = small_cache(4)
    old, new = list(range(100, 108)), list(range(200, 208))
    cache.insert(cache.match("a", old), old, kv, slot=0)  # 2 blocks
    cache.insert(cache.match("a", new), new, kv, slot=0)  # 2 blocks: the budget is full
    running = cache.match("a", old)  # a running request pins old's chain (and makes it recent)
    third = list(range(300, 308))
    assert cache.insert(cache.match("a", third), third, kv, slot=0) == 2  # evicts new (least recent)
    cache.check_integrity()
    assert cache.match("a", new).num_blocks == 0
    assert cache.stats().evicted_blocks == 2
    fourth = list(range(400, 408))
    cache.release(cache.match("a", third))
    # third is now the least recent unpinned chain: its leaf goes first, then its root.
    assert cache.insert(cache.match("a", fourth), fourth, kv, slot=0) == 2
    assert cache.match("a", third).num_blocks == 0
    assert cache.match("a", old).num_blocks == 2  # pinned all along
    # With every block pinned nothing more can be cached, and nothing pinned is lost.
    pins = [cache.match("a", fourth), running]
    fifth = list(range(500, 508))
    assert cache.insert(cache.match("a", fifth), fifth, kv, slot=0) == 0
    assert cache.match("a", old).num_blocks == 2 and cache.match("a", fourth).num_blocks == 2
    for lease in pins:
        cache.release(lease)
    cache.check_integrity()


def chains(cache: PrefixCache, kv: torch.Tensor, scope: str, first: int, count: int) -> list[list[int]]:
    """``count`` distinct 2-block chains of ``scope`` inserted in turn (the last the most recent)."""
    made = [list(range(first + 8 * i, first + 8 * i + 8)) for i in range(count)]
    for tokens in made:
        cache.insert(cache.match(scope, tokens), tokens, kv, slot=0)
    return made


def cached(cache: PrefixCache, scope: str, tokens: list[int]) -> int:
    """The blocks of ``tokens`` that ``scope`` finds cached (the lookup's pins let go at once)."""
    lease = cache.match(scope, tokens)
    found = lease.num_blocks
    cache.release(lease)
    return found


def test_a_flood_of_distinct_prompts_cannot_evict_another_tenant_within_its_share() -> None:
    """b's two chains (4 blocks of 8: its share with a beside it) survive a flood of a's distinct
    prompts, which evict a's own blocks; b's hits are what they would be with a idle."""
    cache, kv = small_cache(8)
    kept = chains(cache, kv, "b", 1000, 2)
    chains(cache, kv, "a", 0, 30)
    cache.check_integrity()
    assert [cached(cache, "b", tokens) for tokens in kept] == [2, 2]
    assert cache.scope_stats("a").num_blocks == 4 and cache.stats().evicted_blocks == (30 - 2) * 2


def test_a_tenant_beyond_its_share_loses_its_least_recent_blocks_down_to_the_share() -> None:
    cache, kv = small_cache(8)
    b = chains(cache, kv, "b", 1000, 3)  # 6 of 8 blocks while b is alone
    chains(cache, kv, "a", 0, 5)  # a's first chain fits the free blocks, then b gives back 2, then a's own go
    cache.check_integrity()
    assert cache.scope_stats("b").num_blocks == 4 and cache.scope_stats("a").num_blocks == 4
    assert [cached(cache, "b", tokens) for tokens in b] == [0, 2, 2]  # its least recent chain went
    # A third tenant shrinks each share to 8 // 3 = 2: the two above it give blocks back, most beyond
    # first, until c is as far beyond the share as the most beyond: then its inserts evict its own.
    chains(cache, kv, "c", 2000, 3)
    cache.check_integrity()
    assert {s: cache.scope_stats(s).num_blocks for s in "abc"} == {"a": 3, "b": 2, "c": 3}


@pytest.mark.parametrize("seed", range(20))
def test_no_insert_takes_another_scope_below_its_share(seed: int) -> None:
    """Random inserts, lookups and releases of four scopes: an insert of one scope never leaves another
    with fewer blocks than it held before, unless it held more than its share (the cache's blocks over
    the scopes holding any, the inserting one counted), and then never fewer than the share."""
    rng = np.random.default_rng(seed)
    cache, kv = small_cache(12)
    for _ in range(120):
        scope = "abcd"[int(rng.integers(0, 4))]
        tokens = prompt_of(int(rng.integers(0, 40)), int(rng.integers(4, 17)))
        before = {s: cache.scope_stats(s).num_blocks for s in "abcd"}
        holding = {s for s, n in before.items() if n} | {scope}
        share = cache.num_blocks // len(holding)
        cache.insert(cache.match(scope, tokens), tokens, kv, slot=0)
        cache.check_integrity()
        for other in set("abcd") - {scope}:
            assert cache.scope_stats(other).num_blocks >= min(before[other], share), (other, before, share)


def test_drop_forgets_a_scope_and_its_leases() -> None:
    cache, kv = small_cache(6)
    a, b = list(range(50, 58)), list(range(60, 68))
    cache.insert(cache.match("a", a), a, kv, slot=0)
    cache.insert(cache.match("b", b), b, kv, slot=0)
    running = cache.match("a", a + [1, 2, 3, 4])
    assert cache.drop("a") == 2
    cache.check_integrity()
    assert cache.match("a", a).num_blocks == 0
    assert cache.insert(running, a + [1, 2, 3, 4], kv, slot=0) == 0  # taken before the drop: nothing
    assert cache.scope_stats("a").num_blocks == 0
    assert cache.match("b", b).num_blocks == 2
    # The dropped blocks are free again: four more blocks fit beside b's two.
    c = list(range(70, 86))
    assert cache.insert(cache.match("c", c), c, kv, slot=0) == 4
    assert cache.stats().evicted_blocks == 0
    cache.check_integrity()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
                    capacity_bytes=1024, block_size=0)  # fmt: skip
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        ModelRunner(tiny_model("llama", vocab_size=VOCAB), prefix_cache_bytes=-1)


# ---- inside the runner ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param, vocab_size=VOCAB, seed=3)


def cached_runner(model, num_slots: int = 2, capacity: int = 1 << 24, **kw) -> ModelRunner:
    return ModelRunner(model, num_slots=num_slots, max_len=128, prefix_cache_bytes=capacity,
                       prefix_block_size=BS, **kw)  # fmt: skip


def decode(runner: ModelRunner, slot: int, truth: list[int], num_tokens: int, seed: int) -> list[int]:
    """Greedy decoding with random right/wrong draft trees (compaction moves rows)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < num_tokens:
        tree = random_tree(rng, truth[len(out) :], int(rng.integers(0, 9)), VOCAB, 0.7)
        (result,) = runner.verify([VerifyStep(slot, tree)])
        out += result.token_ids.tolist()
    return out[:num_tokens]


@pytest.mark.parametrize("backend", ["torch", "model"])
def test_cached_start_equals_a_fresh_prefill(model, backend) -> None:
    """A request that starts from cached KV (a prompt's and an output's rows) holds what a fresh prefill
    of the same tokens computes."""
    runner = cached_runner(model, backend=backend)
    first = prompt_of(1, 13)
    slot = runner.start(first, cache_scope="a")
    decode(runner, slot, hf_greedy(model, first, 40), 12, seed=0)
    context = runner.context_ids(slot)  # 13 + 12 tokens; rows of all but the last are cached on release
    runner.release(slot)
    follow_up = context + prompt_of(2, 6)
    slot = runner.start(follow_up, cache_scope="a")
    assert runner.num_reused(slot) == (len(context) - 1) // BS * BS == 24
    fresh = ModelRunner(model, max_len=128, backend=backend)
    fresh_slot = fresh.start(follow_up)
    n = len(follow_up) - 1
    for mine, theirs in zip(runner.pool.slot_view(slot, n), fresh.pool.slot_view(fresh_slot, n)):
        assert torch.allclose(mine, theirs, atol=1e-5), (mine - theirs).abs().max()


def test_greedy_outputs_identical_with_and_without_the_cache(model) -> None:
    """Calls of an agent session, each prompt extending the last call's prompt and output: drafts,
    acceptance and compaction on top of cached KV give generate's tokens, call after call."""
    runner = cached_runner(model)
    context = prompt_of(3, 9)
    reused = []
    for call in range(4):
        prompt = context + prompt_of(10 + call, 5)
        truth = hf_greedy(model, prompt, 40)
        slot = runner.start(prompt, cache_scope="agent")
        reused.append(runner.num_reused(slot))
        out = decode(runner, slot, truth, 10, seed=call)
        assert out == truth[:10], call
        context = runner.context_ids(slot)
        runner.release(slot)
    assert reused[0] == 0 and all(r >= 12 for r in reused[1:]), reused


def test_packed_steps_mix_cached_and_fresh_requests(model) -> None:
    runner = cached_runner(model, num_slots=3)
    base = prompt_of(4, 21)
    runner.release(runner.start(base, cache_scope="a"))  # caches the prompt's whole blocks
    prompts = [base + prompt_of(5, 3), prompt_of(6, 17), base + prompt_of(7, 9)]
    scopes = ["a", "b", "a"]
    runner.pool.kv[:, :, :, :, 64:].fill_(float("nan"))  # garbage past the cached rows must not leak
    slots = [runner.start(p, cache_scope=s) for p, s in zip(prompts, scopes)]
    assert [runner.num_reused(s) for s in slots] == [20, 0, 20]
    truths = [hf_greedy(model, p, 40) for p in prompts]
    rng = np.random.default_rng(9)
    outs: list[list[int]] = [[], [], []]
    while min(len(o) for o in outs) < 12:
        trees = [random_tree(rng, t[len(o) :], int(rng.integers(0, 7)), VOCAB, 0.7) for t, o in zip(truths, outs)]
        for i, result in enumerate(runner.verify([VerifyStep(s, t) for s, t in zip(slots, trees)])):
            outs[i] += result.token_ids.tolist()
    for out, truth in zip(outs, truths):
        assert out[:12] == truth[:12]


def test_a_tenants_repeated_prompt_hits_and_another_tenants_does_not(model) -> None:
    runner = cached_runner(model)
    prompt = prompt_of(8, 30)
    slot = runner.start(prompt, cache_scope="tenant-a")
    assert runner.num_reused(slot) == 0
    runner.verify([VerifyStep(slot, DraftTree.empty())])
    runner.release(slot)
    again = runner.start(prompt, cache_scope="tenant-a")
    assert runner.num_reused(again) == 28  # prompt[:-1] has 29 tokens: 7 whole blocks
    runner.release(again)
    other = runner.start(prompt, cache_scope="tenant-b")
    assert runner.num_reused(other) == 0
    runner.release(other)
    unscoped = runner.start(prompt)
    assert runner.num_reused(unscoped) == 0
    runner.release(unscoped)
    a, b = runner.prefix_cache.scope_stats("tenant-a"), runner.prefix_cache.scope_stats("tenant-b")
    assert a.hit_tokens == 28 and a.query_tokens == 60 and b.hit_tokens == 0 and b.query_tokens == 30


def test_dropping_a_tenant_drops_its_blocks(model) -> None:
    runner = cached_runner(model)
    prompt = prompt_of(9, 25)
    runner.release(runner.start(prompt, cache_scope="a"))
    runner.release(runner.start(prompt, cache_scope="b"))
    running = runner.start(prompt + [5, 6, 7, 8, 9], cache_scope="a")
    assert runner.prefix_cache.drop("a") == 6
    runner.release(running)  # started before the drop: caches nothing
    slot = runner.start(prompt, cache_scope="a")
    assert runner.num_reused(slot) == 0
    runner.release(slot, keep_cache=False)
    assert runner.prefix_cache.scope_stats("a").num_blocks == 0
    assert runner.prefix_cache.scope_stats("b").num_blocks == 6
    runner.prefix_cache.check_integrity()


def test_the_budget_holds_and_running_requests_keep_their_blocks(model) -> None:
    runner = cached_runner(model, num_slots=2, capacity=0)
    assert runner.prefix_cache is None  # 0 bytes: no cache at all
    block_bytes = runner.pool.bytes_per_row * BS
    runner = cached_runner(model, num_slots=2, capacity=8 * block_bytes)
    first = prompt_of(11, 33)
    runner.release(runner.start(first, cache_scope="a"))  # 8 blocks: the whole budget
    running = runner.start(first, cache_scope="a")  # pins all 8
    assert runner.num_reused(running) == 32
    second = prompt_of(12, 33)
    runner.release(runner.start(second, cache_scope="a"))  # nothing can be evicted: nothing cached
    stats = runner.prefix_cache.stats()
    assert stats.bytes == 8 * block_bytes == stats.capacity_bytes
    assert runner.prefix_cache.match("a", second).num_blocks == 0
    runner.release(running)
    third = prompt_of(13, 17)
    runner.release(runner.start(third, cache_scope="a"))  # evicts first's least recent leaves
    assert runner.prefix_cache.stats().bytes <= 8 * block_bytes
    slot = runner.start(first, cache_scope="a")
    assert runner.num_reused(slot) == 16  # the first half of first's chain survived
    runner.prefix_cache.check_integrity()


def test_a_failed_request_caches_nothing(model) -> None:
    runner = cached_runner(model)
    prompt = prompt_of(14, 21)
    slot = runner.start(prompt, cache_scope="a")
    runner.release(slot, keep_cache=False)
    assert runner.prefix_cache.stats().num_blocks == 0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.start(prompt + [VOCAB + 1], cache_scope="a")
    assert runner.prefix_cache.stats().num_blocks == 0


def test_a_runner_that_keeps_hidden_states_prefills_everything(model) -> None:
    runner = cached_runner(model, keep_hidden=True)
    prompt = prompt_of(15, 21)
    runner.release(runner.start(prompt, cache_scope="a"))
    slot = runner.start(prompt, cache_scope="a")
    assert runner.num_reused(slot) == 0
    assert runner.take_prompt_hidden(slot).shape[0] == len(prompt) - 1


def test_a_published_prompt_serves_requests_that_start_while_it_runs(model) -> None:
    """``start(publish=True)`` caches the prompt once it is prefilled: an agent's parallel trials of one
    task prefill their shared prompt once, with the same greedy tokens; a request that then fails (its
    KV not kept) takes back the blocks nobody else holds."""
    runner = cached_runner(model, num_slots=3)
    prompt = prompt_of(21, 29)
    first = runner.start(prompt, cache_scope="a", publish=True)
    second = runner.start(prompt + [7, 8, 9, 10], cache_scope="a", publish=True)
    assert runner.num_reused(first) == 0 and runner.num_reused(second) == 28  # all 7 of first's blocks
    other = runner.start(prompt, cache_scope="b")
    assert runner.num_reused(other) == 0  # another tenant never sees it
    out = [int(runner.verify([VerifyStep(s, DraftTree.empty())])[0].token_ids[0]) for s in (first, second)]
    assert out[0] == hf_greedy(model, prompt, 1)[0] and out[1] == hf_greedy(model, prompt + [7, 8, 9, 10], 1)[0]
    runner.release(other, keep_cache=False)
    assert runner.prefix_cache.scope_stats("a").num_blocks == 8  # first's 7 and second's one more
    runner.release(second, keep_cache=False)  # second's own block goes; first's it only borrowed stay
    assert runner.prefix_cache.scope_stats("a").num_blocks == 7
    runner.release(first, keep_cache=False)  # nobody holds first's now: gone
    assert runner.prefix_cache.scope_stats("a").num_blocks == 0
    unpublished = runner.start(prompt, cache_scope="a")
    assert runner.prefix_cache.scope_stats("a").num_blocks == 0  # not published unless asked
    runner.release(unpublished, keep_cache=False)
    runner.prefix_cache.check_integrity()
