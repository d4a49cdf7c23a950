"""Triton kernels against their torch references (TRITON_INTERPRET=1 on CPU; `gpu` marker on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.draft_tree import DraftTree
from verifier.kernels import (
    compact_kv,
    compact_kv_reference,
    compact_kv_triton,
    tree_attention,
    tree_attention_reference,
    tree_attention_triton,
    triton_available,
)
from verifier.tree import layout_tree, pack_steps

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_tree(rng: np.random.Generator, n: int) -> DraftTree:
    parents = [int(rng.integers(-1, i)) for i in range(n)]
    return DraftTree(
        rng.integers(0, 100, n).astype(np.int32), np.array(parents, np.int32), np.ones(n, np.float32)
    )


def make_inputs(seed, batch, q_heads, kv_heads, head_dim, prefixes, nodes, device="cpu", dtype=torch.float32):
    rng = np.random.default_rng(seed)
    layouts = [layout_tree(random_tree(rng, n)) for n in nodes]
    step = pack_steps(layouts, [0] * batch, prefixes)
    q_len, kv_len = step.num_rows, step.kv_len + 3  # a few unused trailing rows, as in the cache pool
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(device, dtype)
    return q, k, v, torch.from_numpy(step.prefix_lens).to(device), torch.from_numpy(step.tree_mask).to(device)


def naive_attention(q, k, v, prefix_lens, tree_mask, scale):
    """Row by row, from the definition (what each row may see), for the reference itself."""
    batch, hq, q_len, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(batch):
        p = int(prefix_lens[b])
        for i in range(q_len):
            cols = list(range(p)) + [p + j for j in range(q_len) if tree_mask[b, i, j]]
            for h in range(hq):
                keys, vals = k[b, h // group, cols], v[b, h // group, cols]
                w = torch.softmax((keys @ q[b, h, i]) * scale, dim=0)
                out[b, h, i] = w @ vals
    return out


def test_reference_matches_definition() -> None:
    args = make_inputs(0, 2, 4, 2, 8, prefixes=[5, 0], nodes=[6, 3])
    ref = tree_attention_reference(*args, scale=0.3)
    assert torch.allclose(ref, naive_attention(*args, scale=0.3), atol=1e-6)


@needs_triton
@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,head_dim,prefixes,nodes",
    [
        (1, 2, 2, 16, [37], [20]),  # MHA, tree spans two query blocks
        (2, 4, 2, 16, [5, 40], [6, 0]),  # GQA, one request without a tree
        (2, 6, 2, 24, [0, 33], [3, 12]),  # head_dim not a power of two, empty prefix
    ],
)
def test_tree_attention_triton_matches_reference(batch, q_heads, kv_heads, head_dim, prefixes, nodes) -> None:
    args = make_inputs(1, batch, q_heads, kv_heads, head_dim, prefixes, nodes)
    ref = tree_attention_reference(*args, scale=head_dim**-0.5)
    out = tree_attention_triton(*args, scale=head_dim**-0.5)
    assert torch.allclose(out, ref, atol=2e-6), (out - ref).abs().max()


def compaction_case(seed, device="cpu"):
    rng = np.random.default_rng(seed)
    kv = torch.randn(2, 3, 4, 2, 40, 16, generator=torch.Generator().manual_seed(seed)).to(device)
    slots, bases = [2, 0], [5, 11]
    kept = [np.sort(rng.choice(np.arange(1, 20), size=n, replace=False)) for n in (6, 3)]
    src = np.zeros((2, 7), dtype=np.int64)
    for i, rows in enumerate(kept):
        src[i, : len(rows) + 1] = np.concatenate(([0], rows))
    counts = [len(r) + 1 for r in kept]
    return kv, slots, bases, torch.from_numpy(src), counts


def test_compact_reference_definition() -> None:
    kv, slots, bases, src, counts = compaction_case(0)
    before = kv.clone()
    compact_kv_reference(kv, slots, bases, src, counts)
    for b, (slot, base, count) in enumerate(zip(slots, bases, counts)):
        for j in range(count):
            assert torch.equal(kv[:, :, slot, :, base + j], before[:, :, slot, :, base + int(src[b, j])])
        untouched = before[:, :, slot, :, base + count :]
        assert torch.equal(kv[:, :, slot, :, base + count :], untouched)
    assert torch.equal(kv[:, :, 1], before[:, :, 1])  # other slots untouched


@needs_triton
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compact_triton_matches_reference(seed) -> None:
    kv, slots, bases, src, counts = compaction_case(seed)
    expected = kv.clone()
    compact_kv_reference(expected, slots, bases, src, counts)
    compact_kv_triton(kv, slots, bases, src, counts)
    assert torch.equal(kv, expected)


def test_dispatch_uses_reference_on_cpu_and_rejects_unknown() -> None:
    args = make_inputs(2, 1, 2, 2, 8, prefixes=[4], nodes=[3])
    assert torch.equal(tree_attention(*args, scale=0.5), tree_attention_reference(*args, scale=0.5))
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        tree_attention(*args, scale=0.5, backend="cuda")
    kv, slots, bases, src, counts = compaction_case(3)
    with pytest.raises(ValueError, match="unknown compaction backend"):
        compact_kv(kv, slots, bases, src, counts, backend="nope")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_tree_attention_cuda(dtype, atol) -> None:
    args = make_inputs(
        4, 4, 32, 8, 64, prefixes=[1500, 256, 17, 0], nodes=[64, 32, 1, 0], device="cuda", dtype=dtype
    )
    ref = tree_attention_reference(*args, scale=0.125)
    out = tree_attention(*args, scale=0.125)  # auto: Triton on CUDA
    assert torch.allclose(out.float(), ref.float(), atol=atol), (out.float() - ref.float()).abs().max()


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_compact_cuda() -> None:
    kv, slots, bases, src, counts = compaction_case(5, device="cuda")
    expected = kv.clone()
    compact_kv_reference(expected, slots, bases, src, counts)
    compact_kv(kv, slots, bases, src, counts)  # auto: Triton on CUDA
    assert torch.equal(kv, expected)
