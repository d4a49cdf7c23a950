"""The shape of a draft head: one frozen record, saved with every checkpoint as ``config.json``.

A head borrows the target's token embeddings and its (frozen) ``lm_head``; its own layers follow the
target's attention geometry (hidden size, heads, KV heads, RoPE), so a head trained for one target loads
only with a target of the same shape (``check_target`` says which field differs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KINDS = ("eagle", "medusa", "mtp")
KIND_HELP = {
    "eagle": "EAGLE-1 feature head: fc(cat[embed(next token), hidden]) -> one decoder layer -> lm_head",
    "medusa": "Medusa-1 heads: k zero-initialised residual SiLU blocks on the last hidden state -> lm_head",
    "mtp": "DeepSeek-V3-style sequential MTP modules: eh_proj(cat[enorm(embed), hnorm(hidden)]) -> block",
}


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """Everything needed to rebuild a head's modules (weights come separately).

    ``vocab_size`` is the target's; ``draft_vocab_size`` the rows of the head's output projection (the
    most frequent target tokens, ``d2t`` in the weights maps them back; equal to ``vocab_size`` when not
    reduced). ``num_heads`` is the number of Medusa heads or MTP modules (1 for EAGLE).
    ``hidden_post_norm``: the hidden states fed in are the target's top states after its final norm (what
    the verifier returns); an MTP checkpoint trained on pre-norm states is adapted at load time.
    """

    kind: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    num_heads: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_post_norm: bool = True
    target_model_type: str = "llama"
    target: str = ""  # folder of the target the head was trained for ("" = unknown)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; use one of {', '.join(KINDS)}")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "draft_vocab_size", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if self.kind == "eagle" and self.num_heads != 1:
            raise ValueError(f"an eagle head has num_heads 1, got {self.num_heads}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadConfig:
        """Build from a mapping; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown head config keys: {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def for_target(cls, target_config: Any, kind: str, *, draft_vocab_size: int | None = None,
                   num_heads: int = 1, target: str = "") -> HeadConfig:
        """A head shaped like ``target_config`` (a transformers config: Llama, Qwen2 or GPT-2 names)."""
        c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        hidden = _first(c, "hidden_size", "n_embd")
        heads = _first(c, "num_attention_heads", "n_head")
        kv = getattr(c, "num_key_value_heads", None) or heads
        inter = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
        vocab = c.vocab_size
        return cls(
            kind=kind, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=getattr(c, "head_dim", None) or hidden // heads, intermediate_size=inter, vocab_size=vocab,
            draft_vocab_size=min(draft_vocab_size or vocab, vocab), num_heads=num_heads if kind != "eagle" else 1,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_epsilon", None) or 1e-5),
            rope_theta=float(_rope_theta(c)),
            max_position_embeddings=int(_first(c, "max_position_embeddings", "n_positions")),
            target_model_type=str(getattr(c, "model_type", "")), target=target,
        )  # fmt: skip

    def check_target(self, target_config: Any) -> None:
        """Raise ValueError naming the first field where ``target_config`` differs from the trained shape."""
        other = HeadConfig.for_target(target_config, self.kind, draft_vocab_size=self.draft_vocab_size,
                                      num_heads=self.num_heads)
        for name in ("hidden_size", "vocab_size", "target_model_type"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise ValueError(f"draft head was trained for {name} {mine!r}, the target has {theirs!r}")


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"target config has none of {', '.join(names)}")


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta) if theta is not None else 10000.0
