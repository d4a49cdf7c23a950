"""A tiny random Llama with a real byte-level tokenizer, for smoke runs of the service and its benchmark
(`reprise bench serve --tiny`) and for tests: its steps take milliseconds and its output is gibberish,
but tokenization, chat templates, stop strings and the whole decode path are the real ones."""

from __future__ import annotations

from typing import Any

TINY_VOCAB = 258
TINY_EOS = 256  # "<|end|>"


def byte_level_tokenizer() -> Any:
    """256 byte tokens (no merges), ``<|end|>`` (EOS, 256), ``<|begin|>`` (257), and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

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
    assert fast.eos_token_id == TINY_EOS
    return fast


def tiny_llama(seed: int = 7) -> Any:
    """``verifier.testing.tiny_model`` sized for the byte tokenizer, with its EOS id."""
    from verifier.testing import tiny_model

    model = tiny_model("llama", vocab_size=TINY_VOCAB, seed=seed)
    model.config.eos_token_id = TINY_EOS
    model.generation_config.eos_token_id = TINY_EOS
    return model


def tiny_loaded_model(seed: int = 7) -> Any:
    from verifier.models import LoadedModel

    return LoadedModel(tiny_llama(seed), byte_level_tokenizer(), "tiny-llama")
