"""Accept-and-compact: after a verification step, move the accepted rows of each request's KV cache
into place, so the cache holds exactly the committed path (EAGLE/Medusa copy in place the same way).

    kv        [2, num_layers, num_slots, num_kv_heads, max_rows, head_dim]  the preallocated pool (in place)
    slots     [B] int    each request's slot
    bases     [B] int    first row of the step (the root row; it never moves)
    src_rows  [B, N] int rows to keep, relative to ``bases``, strictly increasing, padded past ``counts``
    counts    [B] int    how many rows of ``src_rows`` are real

Row ``bases[b] + src_rows[b, j]`` moves to ``bases[b] + j``. Because ``src_rows[b, j] >= j`` and rows are
increasing, copying in order never overwrites a row that is still to be read; the reference copies
through a temporary, the kernel loads every row of its tile before storing any.
"""

from __future__ import annotations

import torch


def compact_kv_reference(kv, slots, bases, src_rows, counts) -> None:
    """Pure-torch reference (one gather and one scatter per request, all layers at once)."""
    slots_l = torch.as_tensor(slots).tolist()
    bases_l = torch.as_tensor(bases).tolist()
    counts_l = torch.as_tensor(counts).tolist()
    src = torch.as_tensor(src_rows, device=kv.device, dtype=torch.long)
    for b, (slot, base, count) in enumerate(zip(slots_l, bases_l, counts_l)):
        rows = src[b, :count] + base
        kv[:, :, slot, :, base : base + count] = kv[:, :, slot, :, rows]  # RHS gathers into a copy first


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def compact_kernel(
        KV, Slots, Bases, SrcRows, Counts,
        stride_plane, stride_slot, stride_head, stride_row,
        stride_src, num_heads, head_dim,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # One program per ((k or v) x layer x head, request).
        pid = tl.program_id(0)
        b = tl.program_id(1)
        plane = pid // num_heads
        h = pid % num_heads
        slot = tl.load(Slots + b).to(tl.int64)
        base = tl.load(Bases + b).to(tl.int64)
        count = tl.load(Counts + b)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        n_ok = offs_n < count
        ok = n_ok[:, None] & (offs_d < head_dim)[None, :]
        src = tl.load(SrcRows + b * stride_src + offs_n, mask=n_ok, other=0).to(tl.int64)
        ptr = KV + plane * stride_plane + slot * stride_slot + h * stride_head
        rows = tl.load(ptr + (base + src)[:, None] * stride_row + offs_d[None, :], mask=ok)
        tl.debug_barrier()  # every row is read before any is overwritten
        tl.store(ptr + (base + offs_n)[:, None] * stride_row + offs_d[None, :], rows, mask=ok)

    return compact_kernel


_KERNEL = None


def compact_kv_triton(kv, slots, bases, src_rows, counts) -> None:
    """Triton kernel: one program per (plane x head, request) moves all of that request's kept rows."""
    import triton

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    if kv.stride(-1) != 1:
        raise ValueError("compact_kv_triton needs the KV pool contiguous in head_dim")
    two, num_layers, _, num_heads, _, head_dim = kv.shape
    dev = kv.device
    slots = torch.as_tensor(slots, device=dev, dtype=torch.int32)
    bases = torch.as_tensor(bases, device=dev, dtype=torch.int32)
    counts = torch.as_tensor(counts, device=dev, dtype=torch.int32)
    src_rows = torch.as_tensor(src_rows, device=dev, dtype=torch.int32).contiguous()
    if len(slots) == 0:
        return
    block_n = max(16, triton.next_power_of_2(int(src_rows.shape[1])))
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (two * num_layers * num_heads, len(slots))
    _KERNEL[grid](
        kv, slots, bases, src_rows, counts,
        kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4),
        src_rows.stride(0), num_heads, head_dim,
        BLOCK_N=block_n, BLOCK_D=block_d,
    )  # fmt: skip


def compact_kv(kv, slots, bases, src_rows, counts, backend: str = "auto") -> None:
    """Compact in place; ``backend`` is ``auto`` (Triton on CUDA, reference on CPU), ``triton`` or ``torch``."""
    if backend == "auto":
        backend = "triton" if kv.is_cuda else "torch"
    if backend == "triton":
        compact_kv_triton(kv, slots, bases, src_rows, counts)
    elif backend == "torch":
        compact_kv_reference(kv, slots, bases, src_rows, counts)
    else:
        raise ValueError(f"unknown compaction backend {backend!r}; use auto, triton or torch")
