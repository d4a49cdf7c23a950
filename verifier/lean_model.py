"""A lean forward of the Llama and Qwen2 families over the runner's KV pool (the runner's fast path).

transformers' forward spends a fifth of a plain SmolLM2 step on a CPU outside the matrix products:
module calls, a ``Cache`` object, mask plumbing, a rotary embedding recomputed per call. This forward
reads the same weights (shared, not copied, except the fused projections) and does only the work:

    per layer: x -> RMSNorm -> [q|k|v] = x @ W_qkv (one GEMM) -> RoPE (table lookup) -> write k, v into
    the pool at the step's rows -> SDPA over the slot's rows -> o_proj -> residual -> RMSNorm ->
    [gate|up] = x @ W_gu (one GEMM) -> silu(gate) * up -> down -> residual

Attention masks: none at all for one request's plain row (it sees every cached row) and for a causal
chunk from position 0; SDPA's causal kernel for a chain; the additive tree mask, built once per forward
by the runner, only when a step has draft rows or packs requests of different lengths.

Matrix products (the lm_head included) run on weights prepacked once for MKL (one row) and oneDNN
(several rows) on a CPU in float32 (:class:`Linear`): the largest saving there.

Exactness: every other op is transformers' op in the same dtype and order (RMSNorm in float32 then
cast, RoPE ``q * cos + rotate_half(q) * sin`` with cos/sin computed as transformers computes them);
fused projections only concatenate output columns. Products of several rows are not bit-equal to a
one-row GEMV under any BLAS (their reduction order differs, as it already did between transformers'
own multi-row and one-row calls), so exactness is stated on outputs: greedy tokens equal
``generate``'s (tests/verifier/test_lean_model.py; float32 end to end in ``reprise bench agent``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

LEAN_MODEL_TYPES = ("llama", "qwen2")


def supports_lean(model: Any) -> bool:
    """Whether :class:`LeanForward` can run ``model``: a Llama or Qwen2 causal LM with plain RoPE, SiLU
    and no per-layer extras (sliding windows, scaled RoPE and the like go to transformers)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return False
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return False
    if getattr(config, "use_sliding_window", False):
        return False
    return getattr(config, "pretraining_tp", 1) == 1


class Linear:
    """``x @ weight.T + bias``, with the weight also held prepacked on a CPU (float32), once per kernel:
    in MKL's packed GEMM format for one row (a plain step of one request) and in oneDNN's blocked layout
    for more (draft rows, packed requests, prefill chunks): faster than ``F.linear`` at every row count
    (docs/verifier.md, "The lean forward", has the times). The packed copies cost the weight's memory
    twice more (``pack=False``: plain ``F.linear``)."""

    __slots__ = ("bias", "packed_many", "packed_one", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.weight = weight  # [N, K]
        self.bias = bias  # [N] or None
        cpu = pack and weight.device.type == "cpu"
        cpu32 = cpu and weight.dtype == torch.float32
        cpu16 = cpu and weight.dtype == torch.bfloat16 and _onednn_bf16()
        self.packed_one = (
            torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
            if cpu32 and torch.backends.mkl.is_available()
            else None
        )
        self.packed_many = (
            torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if (cpu32 or cpu16) and torch.backends.mkldnn.is_available()
            else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_one is not None and x.numel() == x.shape[-1]:
            return torch.ops.mkl._mkl_linear(x, self.packed_one, self.weight, self.bias, 1)
        if self.packed_many is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_many, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _onednn_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (AVX512-BF16 or AMX): its packed bfloat16
    products then run at 1.5-2x ``F.linear``'s speed for one to a few rows."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's weights (views of the model's, the fused matrices concatenated once)."""

    norm1: torch.Tensor  # [d]
    qkv: Linear  # [(Hq + 2 Hkv) D, d], with the [(Hq + 2 Hkv) D] bias of Qwen2
    o: Linear  # [d, Hq D]
    norm2: torch.Tensor  # [d]
    gate_up: Linear  # [2 I, d]
    down: Linear  # [d, I]


class LeanForward:
    """The base model's forward, returning the top hidden state (after the final norm, what ``lm_head``
    reads) and writing every row's K and V into the runner's pool."""

    def __init__(self, model: Any, *, pack: bool = True) -> None:
        if not supports_lean(model):
            raise ValueError(f"no lean forward for {type(model).__name__}; use the transformers forward")
        base = model.base_model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        rotary = base.rotary_emb
        self.inv_freq = rotary.inv_freq.float()  # [D/2]
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        with torch.no_grad():
            self.layers = [self._layer(layer, pack) for layer in base.layers]
            head = model.get_output_embeddings()
            self.lm_head = Linear(head.weight, head.bias, pack)

    @staticmethod
    def _layer(layer: Any, pack: bool) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        bias = None
        if att.q_proj.bias is not None:
            bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]).contiguous()
        return _Layer(
            norm1=layer.input_layernorm.weight,
            qkv=Linear(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).contiguous(), bias, pack),
            o=Linear(att.o_proj.weight, None, pack),
            norm2=layer.post_attention_layernorm.weight,
            gate_up=Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(), None, pack),
            down=Linear(mlp.down_proj.weight, None, pack),
        )  # fmt: skip

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm, op for op (float32 statistics, then the input dtype)."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin ``[B, 1, Q, D]`` of the rows' positions, computed as transformers
        computes cos and sin; the sin's first half negated, so that ``rotate_half(x) * sin`` is
        ``roll(x, D / 2) * signed_sin`` bit for bit (a negation is exact) in fewer ops."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, Q, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos[:, None], signed[:, None]

    def __call__(
        self,
        kv: torch.Tensor,
        slots: list[int],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_start: list[int],
        kv_len: int,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """``input_ids``/``position_ids`` ``[B, Q]``; request b's rows are written to pool rows
        ``write_start[b] ..+ Q`` of slot ``slots[b]`` (``kv [2, layers, slots, Hkv, rows, D]``), and
        attention reads its slot's first ``kv_len`` rows under ``mask`` (additive ``[B, 1, Q, kv_len]``),
        causally (``causal``: one chain from row 0, ``kv_len == Q``), or unmasked (``mask`` None). Returns
        ``[B, Q, d]``."""
        batch, q_len = input_ids.shape
        hq, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)  # [B, Q, d]
        cos, signed_sin = self._rope(position_ids, x.dtype)
        half = dh // 2
        first = slots[0]
        # Consecutive slots are read as a view (no copy of their rows); their writes are slices when
        # every request writes the same rows. Otherwise index tensors, built once for every layer.
        consecutive = slots == list(range(first, first + batch))
        same_rows = len(set(write_start)) == 1
        slot_rows = torch.tensor(slots, device=x.device)  # [B]
        write_rows = torch.tensor(write_start, device=x.device)[:, None] + torch.arange(
            q_len, device=x.device
        )
        gqa = hkv != hq
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.norm1)
            qkv = layer.qkv(h)  # [B, Q, (Hq + 2 Hkv) D]
            qk, v = qkv.split(((hq + hkv) * dh, hkv * dh), dim=-1)
            qk = qk.view(batch, q_len, hq + hkv, dh).transpose(1, 2)  # [B, Hq + Hkv, Q, D]
            v = v.view(batch, q_len, hkv, dh).transpose(1, 2)  # [B, Hkv, Q, D]
            qk = qk * cos + torch.roll(qk, half, dims=-1) * signed_sin  # RoPE on q and k at once
            q, k = qk.split((hq, hkv), dim=1)
            keys, values = kv[0, i], kv[1, i]  # [S, Hkv, R, D]
            if consecutive and same_rows:
                start = write_start[0]
                keys[first : first + batch, :, start : start + q_len] = k
                values[first : first + batch, :, start : start + q_len] = v
            else:
                keys[slot_rows[:, None], :, write_rows] = k.transpose(1, 2)  # [B, Q, Hkv, D]
                values[slot_rows[:, None], :, write_rows] = v.transpose(1, 2)
            if consecutive:
                k_all = keys[first : first + batch, :, :kv_len]
                v_all = values[first : first + batch, :, :kv_len]
            else:
                k_all = keys[:, :, :kv_len].index_select(0, slot_rows)
                v_all = values[:, :, :kv_len].index_select(0, slot_rows)
            out = F.scaled_dot_product_attention(
                q, k_all, v_all, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
            )  # [B, Hq, Q, D]
            out = out.transpose(1, 2).reshape(batch, q_len, hq * dh)
            x = x + layer.o(out)
            h = self._norm(x, layer.norm2)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self._norm(x, self.final_norm)


_SHARED: weakref.WeakKeyDictionary[Any, LeanForward] = weakref.WeakKeyDictionary()


def lean_forward_of(model: Any) -> LeanForward:
    """The model's lean forward with packed weights, built once and shared by every runner of the model
    (the packed copies are the weights' size again, twice). The fused and packed matrices are copies
    taken then: a model whose weights change afterwards needs ``LeanForward(model)`` anew."""
    lean = _SHARED.get(model)
    if lean is None:
        lean = _SHARED[model] = LeanForward(model)
    return lean
