"""Tiny random-initialised target models for tests and demos (milliseconds per forward, fp32).

Real transformers models of the supported families, not fakes: 2 layers, hidden size 64, a small
vocabulary. ``initializer_range`` is raised from transformers' 0.02 so that next-token distributions are
peaked rather than nearly uniform: argmax near-ties would make exactness tests flaky under fp32 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from retrieval.draft_tree import DraftTree

FAMILIES = ("llama", "qwen2", "gpt2")


def tiny_model(
    family: str = "llama", *, vocab_size: int = 256, seed: int = 0, init_range: float = 0.2
) -> Any:
    """A random ``{family}`` causal LM: vocab ``vocab_size``, d 64, 2 layers, 4 heads (2 KV heads)."""
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "initializer_range": init_range,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    config: Any
    model: Any
    if family == "llama":
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, **common,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    elif family == "qwen2":
        config = Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, **common,
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
    elif family == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], num_tokens: int, eos: bool = False) -> list[int]:
    """transformers ``generate`` greedy continuation of ``prompt`` (EOS ignored unless ``eos``)."""
    config = GenerationConfig(do_sample=False, max_new_tokens=num_tokens, pad_token_id=0)
    if eos:
        config.eos_token_id = model.config.eos_token_id
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = config.eos_token_id  # generate falls back to it when unset
    try:
        out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt) :].tolist()


def full_logits(model: Any, ids: list[int]) -> Any:
    """Logits ``[len(ids), V]`` (fp32) of one plain forward pass without a cache."""
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device)).logits[0].float()


def random_tree(rng: Any, truth: list[int], num_nodes: int, vocab: int, p_right: float) -> Any:
    """A random draft tree whose nodes follow ``truth`` (the true continuation) with probability
    ``p_right`` while their path is still on it, and are random tokens otherwise: right, wrong and
    mixed drafts in one generator."""
    parents: list[int] = []
    tokens: list[int] = []
    on_truth: list[int] = []  # depth along the truth, or -1 once off it
    for i in range(num_nodes):
        parent = int(rng.integers(-1, i)) if i else -1
        depth = 0 if parent < 0 else (on_truth[parent] + 1 if on_truth[parent] >= 0 else -1)
        if 0 <= depth < len(truth) and rng.random() < p_right:
            token, state = truth[depth], depth
        else:
            token, state = int(rng.integers(0, vocab)), -1
        parents.append(parent)
        tokens.append(token)
        on_truth.append(state)
    return DraftTree(
        np.array(tokens, np.int32), np.array(parents, np.int32), np.full(num_nodes, 0.5, np.float32)
    )


def chi_square(counts: Any, probs: Any, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``probs`` and its degrees of freedom; cells
    expected below ``min_expected`` are pooled into one. Cells with probability 0 must be empty."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if np.any(counts[probs <= 0] > 0):
        raise AssertionError("a zero-probability outcome was observed")
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi_square_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper ``alpha`` quantile of the chi-square distribution (Wilson-Hilferty; alpha 1e-2 or 1e-3)."""
    z = {1e-2: 2.3263, 1e-3: 3.0902}[alpha]
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
