"""Llama-style building blocks of the draft heads, with the KV cache and masks in the caller's hands.

Written out (rather than borrowed from transformers) because drafting needs two things a stock layer does
not give cheaply: queries of a draft tree attending to a cached context plus their own ancestors
(an explicit additive mask), and a context cache that grows by a few rows per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neural_drafters.config import HeadConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (half-split layout, as Llama): ``x`` [B, H, L, Dh], ``positions`` [B, L]."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))  # [Dh/2]
    angles = positions.to(torch.float32)[:, None, :, None] * inv  # [B, 1, L, Dh/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    """Grouped-query attention whose keys are ``past`` (given) followed by this call's own rows."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.theta = c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, L, d]
        positions: torch.Tensor,  # [B, L]
        past: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([B, Hkv, P, Dh], same)
        mask: torch.Tensor | None = None,  # [B, 1, L, P + L] additive float; None = causal over L (no past)
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        new = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if mask is None and past is not None and past[0].shape[2]:
            raise ValueError("a mask is required when attending to cached keys")
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.num_kv != self.num_heads
        )  # [B, H, L, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), new


class MLP(nn.Module):
    """SwiGLU feed-forward (Llama)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm transformer block; ``input_norm=False`` drops the first norm (EAGLE-1's layer 0)."""

    def __init__(self, config: HeadConfig, input_norm: bool = True) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm: nn.Module = RMSNorm(config.hidden_size, eps) if input_norm else nn.Identity()
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)

    def forward(self, x, positions, past=None, mask=None):
        attn, new = self.self_attn(self.input_layernorm(x), positions, past, mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), new


class KVCache:
    """The context rows of one decoder layer for one request: grows by doubling, read as views."""

    def __init__(self, num_kv: int, head_dim: int, dtype: torch.dtype, capacity: int = 256) -> None:
        self.k = torch.zeros(1, num_kv, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add rows ``k``/``v`` [1, Hkv, n, Dh] after the current ones."""
        n = k.shape[2]
        end = self.length + n
        if end > self.k.shape[2]:
            size = max(2 * self.k.shape[2], end)
            grown_k = self.k.new_zeros(1, self.k.shape[1], size, self.k.shape[3])
            grown_v = torch.zeros_like(grown_k)
            grown_k[:, :, : self.length] = self.k[:, :, : self.length]
            grown_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]
