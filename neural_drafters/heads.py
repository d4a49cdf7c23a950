"""The draft heads: EAGLE-1 feature head, Medusa-1 residual heads, DeepSeek-V3-style MTP modules.

Every head reads the target's top hidden states and decodes through the target's frozen ``lm_head``
(restricted to the draft vocabulary, ``d2t``); token embeddings are the target's too (``TargetParts``).

* EAGLE-1 (Li et al., arXiv 2401.15077): ``f_{t+1} = layer(fc(cat[embed(x_{t+1}), f_t]))``, one decoder
  layer without its input norm; drafting feeds predicted features back in, one position per depth.
* Medusa-1 (Cai et al., arXiv 2401.10774): head k is ``h + SiLU(W_k h)`` (W_k zero-initialised, so a new
  head starts as the target's own next-token head); from ``h_t`` it predicts token ``t+1+k``.
* DeepSeek-V3 MTP (arXiv 2412.19437, section 2.2): module k is
  ``block(eh_proj(cat[enorm(embed(x_{t+k})), hnorm(h^{k-1}_t)]))`` decoded by ``lm_head(norm_k(.))``; module
  k drafts depth k. A checkpoint trained on pre-final-norm states takes the verifier's post-norm states
  through ``hidden_scale`` (below) instead of ``hnorm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from neural_drafters.config import HeadConfig
from neural_drafters.layers import DecoderLayer, RMSNorm


class EagleHead(nn.Module):
    """EAGLE-1: fc over cat[token embedding, feature], then one decoder layer (no input norm)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.layer = DecoderLayer(config, input_norm=False)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))

    def module(self, depth: int) -> EagleHead:
        return self

    def forward(self, embeds, hidden, positions, past=None, mask=None):
        """``embeds``, ``hidden`` [B, L, d] -> predicted next features [B, L, d] and this call's (k, v)."""
        return self.layer(self.fc(torch.cat([embeds, hidden], -1)), positions, past, mask)

    def output_features(self, features: torch.Tensor) -> torch.Tensor:
        return features  # predicted post-norm features go straight to lm_head


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP module; ``hidden_scale`` (if set) replaces ``hnorm`` for post-norm inputs."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = DecoderLayer(config, input_norm=True)
        self.norm = RMSNorm(d, eps)
        self.register_buffer("hidden_scale", None, persistent=False)  # [d], set for post-norm inputs

    def forward(self, embeds, hidden, positions, past=None, mask=None):
        h = hidden * self.hidden_scale if self.hidden_scale is not None else self.hnorm(hidden)
        return self.block(self.eh_proj(torch.cat([self.enorm(embeds), h], -1)), positions, past, mask)


class MTPHead(nn.Module):
    """``num_heads`` sequential MTP modules; module k (1-based) drafts depth k."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.modules_ = nn.ModuleList(MTPModule(config) for _ in range(config.num_heads))
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))

    def module(self, depth: int) -> MTPModule:
        module: MTPModule = self.modules_[depth - 1]  # type: ignore[assignment]
        return module

    def set_post_norm_inputs(self, final_norm_weight: torch.Tensor) -> None:
        """Adapt modules trained on pre-norm states to post-norm ones, exactly (up to the norm's eps).

        ``post = x / rms(x) * w_final`` and ``hnorm(x) = x / rms(x) * w_h``, so ``hnorm(x) = post * w_h /
        w_final`` elementwise: no rms of ``x`` is needed. Only module 1 reads target states.
        """
        first = self.module(1)
        w = final_norm_weight.detach().to(first.hnorm.weight.dtype)
        if bool((w == 0).any()):
            raise ValueError("the target's final norm has zero weights: post-norm states lose information")
        first.hidden_scale = first.hnorm.weight.detach() / w

    def output_features(self, features: torch.Tensor, depth: int) -> torch.Tensor:
        return self.module(depth).norm(features)


class ResBlock(nn.Module):
    """Medusa's residual block ``x + SiLU(W x + b)``, W zero-initialised."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHead(nn.Module):
    """``num_heads`` residual blocks on the last hidden state; head k predicts token t+1+k."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_heads))
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., d] -> features [K, ..., d] for lm_head, one per head."""
        return torch.stack([block(hidden) for block in self.blocks])


def build_head(config: HeadConfig) -> Any:
    """A freshly initialised head of ``config.kind`` (float32, eval mode)."""
    cls = {"eagle": EagleHead, "medusa": MedusaHead, "mtp": MTPHead}[config.kind]
    return cls(config).eval()


@dataclass
class TargetParts:
    """What a head borrows from its target, frozen: token embeddings [V, d], the ``lm_head`` rows of the
    draft vocabulary [Vd, d], and the final norm's weight [d] (for MTP modules trained pre-norm)."""

    embed: torch.Tensor  # [V, d]
    lm_head: torch.Tensor  # [Vd, d]
    final_norm: torch.Tensor | None = None  # [d]

    @classmethod
    def from_model(cls, model: Any, d2t: torch.Tensor) -> TargetParts:
        """Share the weights of a loaded transformers causal LM (no copy of the embeddings)."""
        embed = model.get_input_embeddings().weight.detach()
        head = model.get_output_embeddings().weight.detach()
        norm = getattr(model.base_model, "norm", None) or getattr(model.base_model, "ln_f", None)
        weight = getattr(norm, "weight", None)
        return cls(embed.float(), head[d2t.to(head.device)].float(),
                   None if weight is None else weight.detach().float())

    @classmethod
    def from_folder(cls, folder: str, d2t: torch.Tensor) -> TargetParts:
        """Read only the needed tensors from a safetensors model folder (no model is built)."""
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in the target folder {folder!r}")
        found: dict[str, torch.Tensor] = {}
        wanted = {
            "embed": ("model.embed_tokens.weight", "transformer.wte.weight"),
            "lm_head": ("lm_head.weight",),
            "norm": ("model.norm.weight", "transformer.ln_f.weight"),
        }
        for path in files:
            with safe_open(str(path), framework="pt") as fh:
                keys = set(fh.keys())
                for part, names in wanted.items():
                    for name in names:
                        if part not in found and name in keys:
                            found[part] = fh.get_tensor(name)
        if "embed" not in found:
            raise ValueError(f"the target folder {folder!r} has no token embedding tensor")
        head = found.get("lm_head", found["embed"])  # tied embeddings (SmolLM2, GPT-2)
        return cls(found["embed"].float(), head[d2t].float(), found.get("norm"))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., Vd]`` of features ``[..., d]``."""
        return torch.nn.functional.linear(features, self.lm_head)  # ~4x faster than `@ lm_head.T` on CPU
