"""The canonical tokenization of FORMAT.md and its per-message cache."""

from __future__ import annotations

import numpy as np
import pytest

from replay_traces.tokenizer import CanonicalTokenizer, tokenizer_names
from replay_traces.traces import Message

MESSAGES = (Message("system", "You are terse."), Message("user", "List files\nin /tmp"),
            Message("assistant", "ls /tmp"), Message("tool", "a.txt b.txt"))


def test_prompt_is_the_concatenation_of_per_message_encodings_then_the_header(tokenizer):
    enc = tokenizer._encoding
    expected = []
    for m in MESSAGES:
        expected += enc.encode_ordinary(f"<|{m.role}|>\n{m.content}\n")
    expected += enc.encode_ordinary("<|assistant|>\n")
    got = tokenizer.prompt_ids(MESSAGES)
    assert got.dtype == np.int32
    assert got.tolist() == expected
    # Per-message encoding differs from encoding the joined text at message seams, so the layout matters.
    assert enc.decode(expected) == "".join(f"<|{m.role}|>\n{m.content}\n" for m in MESSAGES) + "<|assistant|>\n"


def test_empty_prompt_is_just_the_header(tokenizer):
    assert tokenizer.prompt_ids(()).tolist() == tokenizer._encoding.encode_ordinary("<|assistant|>\n")


def test_response_is_plain_encode(tokenizer):
    text = "THOUGHT: look\n```bash\nls\n```"
    assert tokenizer.response_ids(text).tolist() == tokenizer._encoding.encode_ordinary(text)


@pytest.mark.parametrize("special", ["<|endoftext|>", "<|fim_prefix|>", "<|endofprompt|>"])
def test_special_token_text_is_encoded_as_plain_text(tokenizer, special):
    ids = tokenizer.response_ids(f"a {special} b").tolist()
    specials = {tokenizer._encoding.encode_single_token(s) for s in tokenizer._encoding.special_tokens_set}
    assert not specials & set(ids)
    assert tokenizer._encoding.decode(ids) == f"a {special} b"
    prompt = tokenizer.prompt_ids((Message("user", special),)).tolist()
    assert not specials & set(prompt)


def test_texts_beyond_bpe_openai_limits_still_encode(tokenizer):
    text = "word " * 250_000  # 1.25 M characters: encode_ordinary alone refuses this
    ids = tokenizer.encode(text)
    assert len(ids) >= 250_000
    assert tokenizer._encoding.decode(ids.tolist()) == text


def test_cache_reuses_message_encodings():
    tok = CanonicalTokenizer()
    tok.prompt_ids(MESSAGES[:2])
    misses = tok.misses
    again = tok.prompt_ids(MESSAGES[:3])
    assert tok.misses == misses + 1  # only the new message was encoded
    assert tok.hits >= 2
    assert again.tolist() == CanonicalTokenizer().prompt_ids(MESSAGES[:3]).tolist()
    cached = tok.message_ids("user", "List files\nin /tmp")
    assert not cached.flags.writeable


def test_cache_is_bounded_by_tokens_and_drops_least_recently_used():
    tok = CanonicalTokenizer(max_cached_tokens=40)
    for i in range(30):
        tok.message_ids("user", f"message number {i} with some words")
        assert tok.cached_tokens <= 40
    misses = tok.misses
    tok.message_ids("user", "message number 29 with some words")  # most recent: still cached
    assert tok.misses == misses
    tok.message_ids("user", "message number 0 with some words")  # long gone
    assert tok.misses == misses + 1


def test_unknown_tokenizer_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tokenizer 'nope'.*cl100k_base"):
        CanonicalTokenizer("nope")
    assert "cl100k_base" in tokenizer_names()
