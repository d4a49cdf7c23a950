"""Tree-masked attention over the KV cache (SpecInfer-style tree attention; flash-attention online softmax).

Inputs for a packed step of B requests, Q rows each (see verifier/tree.py):

    q            [B, Hq, Q, D]   queries of the step's rows
    k, v         [B, Hkv, L, D]  keys/values: request b's cached prefix at [0, prefix_lens[b]), the step's
                                 own rows at [prefix_lens[b], prefix_lens[b] + Q); L >= max(prefix) + Q
    prefix_lens  [B] int         cached rows before the step, visible to every row
    tree_mask    [B, Q, Q] bool  row i may see step row j (ancestor-or-self)
    -> out       [B, Hq, Q, D]

GQA: query head h reads KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch

from verifier.tree import additive_mask


def tree_attention_reference(q, k, v, prefix_lens, tree_mask, scale: float, mask=None):
    """Pure-torch reference: a float additive mask and scaled dot-product attention (GQA without
    copying the KV heads). ``mask`` [B, 1, Q, L]: that mask, already built (the runner builds it once
    per forward rather than once per layer); by default it is built from ``prefix_lens`` and
    ``tree_mask``."""
    if mask is None:
        mask = additive_mask(prefix_lens, tree_mask, k.shape[2], q.dtype).to(q.device)  # [B, 1, Q, L]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def _kernel():
    """Build the Triton kernel on first use (triton is imported lazily, after TRITON_INTERPRET is set)."""
    import triton
    import triton.language as tl

    @triton.jit
    def tree_attention_kernel(
        Q, K, V, Out, PrefixLens, TreeMask,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        stride_tb, stride_tm, stride_tn,
        num_q_heads, group, num_rows, head_dim, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # One program per (block of query rows, batch x query head).
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // num_q_heads
        h = pid_bh % num_q_heads
        kvh = h // group
        prefix = tl.load(PrefixLens + b)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < num_rows
        d_ok = offs_d < head_dim
        q = tl.load(
            Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Pass 1 walks the cached prefix (every column visible), pass 2 the step's own rows (tree mask).
        for part in tl.static_range(2):
            if part == 0:
                num_cols = prefix
            else:
                num_cols = num_rows
            for start in range(0, num_cols, BLOCK_N):
                rel = start + offs_n
                n_ok = rel < num_cols
                if part == 0:
                    cols = rel
                    allowed = m_ok[:, None] & n_ok[None, :]
                else:
                    cols = prefix + rel
                    tm = tl.load(
                        TreeMask + b * stride_tb + offs_m[:, None] * stride_tm + rel[None, :] * stride_tn,
                        mask=m_ok[:, None] & n_ok[None, :],
                        other=0,
                    )
                    allowed = tm != 0
                k = tl.load(
                    k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                    mask=n_ok[None, :] & d_ok[:, None],
                    other=0.0,
                )  # [D, N]
                if IEEE:
                    s = tl.dot(q, k, input_precision="ieee")
                else:
                    s = tl.dot(q, k)
                s = tl.where(allowed, s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )  # [N, D]
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # padded query rows of the last block
        out = acc / l_safe[:, None]
        tl.store(
            Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
            out.to(Out.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )

    return tree_attention_kernel


_KERNEL = None


def tree_attention_triton(q, k, v, prefix_lens, tree_mask, scale: float):
    """Triton kernel: one program per (16-row query block, request x query head); online softmax over
    the prefix (unmasked) then over the step's rows (tree mask)."""
    import triton

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} not a multiple of KV heads {num_kv_heads}")
    out = torch.empty_like(q)
    prefix_lens = torch.as_tensor(prefix_lens, device=q.device, dtype=torch.int32)
    tree_mask = torch.as_tensor(tree_mask, device=q.device).to(torch.int8)
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (triton.cdiv(q_len, 16), batch * num_q_heads)
    _KERNEL[grid](
        q, k, v, out, prefix_lens, tree_mask,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *tree_mask.stride(),
        num_q_heads, num_q_heads // num_kv_heads, q_len, head_dim, float(scale),
        BLOCK_M=16, BLOCK_N=32, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return out


def tree_attention(q, k, v, prefix_lens, tree_mask, scale: float, backend: str = "auto", mask=None):
    """Tree attention; ``backend`` is ``auto`` (Triton on CUDA, reference on CPU), ``triton`` or ``torch``
    (which takes a prebuilt additive ``mask``, see :func:`tree_attention_reference`)."""
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "triton":
        return tree_attention_triton(q, k, v, prefix_lens, tree_mask, scale)
    if backend == "torch":
        return tree_attention_reference(q, k, v, prefix_lens, tree_mask, scale, mask)
    raise ValueError(f"unknown attention backend {backend!r}; use auto, triton or torch")
