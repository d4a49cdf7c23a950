"""A tiny random Llama with a real byte-level tokenizer, for smoke runs of the service and its benchmark
(`reprise bench serve --tiny`) and for tests: its steps take milliseconds and its output is gibberish,
but tokenization, chat templates, stop strings and the whole decode path are the real ones."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from verifier.models import LoadedModel
from verifier.testing import tiny_model

TINY_VOCAB = 258
TINY_EOS = 256  # "<|end|>"


# A chat template that renders tools and an assistant's tool calls itself, Hermes-style (as Qwen2.5's does).
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|begin|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|end|>\n{% endif %}"
    "{% for m in messages %}<|begin|>{{ m['role'] }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|begin|>assistant\n{% endif %}"
)


def byte_level_tokenizer(tool_template: bool = False) -> Any:
    """256 byte tokens (no merges), ``<|end|>`` (EOS, 256), ``<|begin|>`` (257), and a chat template
    (with ``tool_template``, one that renders tools and tool calls itself)."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|end|>", "bos_token": "<|begin|>"})
    fast.chat_template = (
        "{% for m in messages %}<|begin|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|begin|>assistant\n{% endif %}"
    )
    if tool_template:
        fast.chat_template = TOOL_CHAT_TEMPLATE
    assert fast.eos_token_id == TINY_EOS
    return fast


def tiny_llama(seed: int = 7) -> Any:
    """``verifier.testing.tiny_model`` sized for the byte tokenizer, with its EOS id."""
    model = tiny_model("llama", vocab_size=TINY_VOCAB, seed=seed)
    model.config.eos_token_id = TINY_EOS
    model.generation_config.eos_token_id = TINY_EOS
    return model


def tiny_loaded_model(seed: int = 7) -> Any:
    return LoadedModel(tiny_llama(seed), byte_level_tokenizer(), "tiny-llama")
