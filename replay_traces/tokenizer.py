"""The canonical replay tokenization (docs/replay.md).

Prompt tokens are the concatenation, over the prompt's messages, of
``encode(f"<|{role}|>\\n{content}\\n")``, followed by ``encode("<|assistant|>\\n")``; response tokens are
``encode(content)``. Text is always encoded as plain text: a message that contains ``<|endoftext|>``
gets the tokens of those characters, never the special token (bpe_openai's ``encode`` would raise on it;
its ``encode_ordinary`` path is what we use). Call k+1's prompt repeats call k's messages, so encodings
are cached per message in a bounded LRU: replaying a trajectory costs its length, not its square.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from replay_traces.traces import Message

DEFAULT_TOKENIZER = "cl100k_base"
ASSISTANT_HEADER = "<|assistant|>\n"


def _bpe_openai():
    # Imported on first use: loading its tables takes about a second, which ``reprise --help`` (it imports
    # this module) must not pay; and it loads them with a deprecated importlib call (on import and on
    # first use), whose warning is silenced here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import bpe_openai
    return bpe_openai


def tokenizer_names() -> list[str]:
    """Encodings bpe_openai ships (no download needed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return sorted(_bpe_openai().list_encoding_names())


class CanonicalTokenizer:
    """Encodes trace prompts and responses the canonical way, with a bounded per-message cache.

    ``max_cached_tokens`` bounds the cache by the tokens it holds (4 bytes each); the least recently
    used messages are dropped first.
    """

    def __init__(self, name: str = DEFAULT_TOKENIZER, *, max_cached_tokens: int = 16_000_000) -> None:
        known = tokenizer_names()
        if name not in known:
            raise ValueError(f"unknown tokenizer {name!r}; known: {', '.join(known)}")
        if max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be >= 0, got {max_cached_tokens}")
        self.name = name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self._encoding = _bpe_openai().get_encoding(name)
        # encode_ordinary refuses texts of 1M characters or 200k tokens; trace messages can be larger
        # (a whole file printed by a tool), so such texts go straight to the same Rust backend.
        self._backend = getattr(self._encoding, "_backend", None)
        self.max_cached_tokens = max_cached_tokens
        self._cache: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self.hits = 0
        self.misses = 0
        self._header = self.encode(ASSISTANT_HEADER)

    def encode(self, text: str) -> np.ndarray:
        """Plain-text token ids of ``text`` (special-token text is ordinary text), int32."""
        try:
            ids = self._encoding.encode_ordinary(text)
        except ValueError:  # bpe_openai's length limits (TokenLimitError is a ValueError too)
            if self._backend is None:
                raise
            ids = self._backend.encode(self._encoding._sanitize_text(text))
        return np.asarray(ids, dtype=np.int32)

    def message_ids(self, role: str, content: str) -> np.ndarray:
        """``encode(f"<|{role}|>\\n{content}\\n")``, cached; the array is read-only."""
        key = (role, content)
        ids = self._cache.get(key)
        if ids is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return ids
        self.misses += 1
        ids = self.encode(f"<|{role}|>\n{content}\n")
        ids.flags.writeable = False
        if len(ids) <= self.max_cached_tokens:
            self._cache[key] = ids
            self._cached_tokens += len(ids)
            while self._cached_tokens > self.max_cached_tokens:
                _, dropped = self._cache.popitem(last=False)
                self._cached_tokens -= len(dropped)
        return ids

    def prompt_ids(self, messages: Iterable[Message]) -> np.ndarray:
        """The canonical prompt: every message's encoding, then the assistant header; int32."""
        parts = [self.message_ids(m.role, m.content) for m in messages]
        parts.append(self._header)
        return np.concatenate(parts)

    def response_ids(self, text: str) -> np.ndarray:
        """The canonical response tokens: ``encode(text)``; int32."""
        return self.encode(text)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (specials included)."""
        return int(self._encoding.n_vocab)

    def decode_token(self, token_id: int) -> str:
        """The text of one token id (lossy for ids that are partial UTF-8 sequences)."""
        return self._encoding.decode([token_id])

    @property
    def cached_tokens(self) -> int:
        """Tokens currently held by the message cache."""
        return self._cached_tokens

    def __repr__(self) -> str:
        return f"CanonicalTokenizer({self.name!r}, cached_tokens={self._cached_tokens})"
