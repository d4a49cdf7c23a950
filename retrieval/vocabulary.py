"""Token classes for canonical matching (number tokens become class ids, everything else stays), and
token categories for the fallback guesses.

Agents repeat structure around fresh values ("Total: $1,436\\n\\nWould you like..."): an exact suffix
match breaks at the new number, so history that differs only in its numbers is out of reach (Oilbird,
arXiv 2608.03839, calls this an addressing miss). Canonical indexes store sequences with every token
that decodes to digits (optionally after one space) replaced by a class id, and drafts from them stop
before a class id, so structure after a number is drafted while the number itself never is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from suffix_index.drafting import CLASS_BASE

_NUMBER = re.compile(r" ?[0-9]+")

#: Class ids: plain digits, digits after a space.
CLASS_NUMBER = CLASS_BASE
CLASS_SPACED_NUMBER = CLASS_BASE + 1


def number_classes(decode: Callable[[int], str], vocab_size: int) -> np.ndarray:
    """``classes[token_id]`` = the token's class id if it decodes to a number, else the id itself.

    ``decode(token_id)`` returns the token's text; ids it cannot decode (raising) stay themselves.
    """
    texts = _texts(decode, vocab_size)
    classes = np.arange(vocab_size, dtype=np.int32)
    for token_id, text in texts:
        if _NUMBER.fullmatch(text):
            classes[token_id] = CLASS_SPACED_NUMBER if text.startswith(" ") else CLASS_NUMBER
    classes.flags.writeable = False
    return classes


def token_categories(decode: Callable[[int], str], vocab_size: int) -> np.ndarray:
    """``categories[token_id]`` in [0, 25): what the fallback table conditions its guesses on.

    What follows a word the tenant's history never continued depends mostly on the word's shape: a
    token that starts a word (after a space or a newline) or continues one, is letters, digits,
    whitespace or punctuation, ends a line. 0: ids ``decode`` cannot decode or that decode to nothing.
    """
    texts = _texts(decode, vocab_size)
    categories = np.zeros(vocab_size, dtype=np.uint8)
    for token_id, text in texts:
        if text:
            categories[token_id] = _category(text)
    categories.flags.writeable = False
    return categories


def _texts(decode: Callable[[int], str], vocab_size: int) -> Iterator[tuple[int, str]]:
    """(id, text) of every id below ``vocab_size`` that ``decode`` decodes (special or unused ids, any
    decoder error, are left out); a bad ``vocab_size`` raises here, before anything is allocated."""
    if not 0 < vocab_size < CLASS_BASE:
        raise ValueError(f"vocab_size must be in [1, {CLASS_BASE}), got {vocab_size}")

    def walk() -> Iterator[tuple[int, str]]:
        for token_id in range(vocab_size):
            try:
                text = decode(token_id)
            except Exception:  # noqa: BLE001, S112 - not decodable: left out
                continue
            yield token_id, text

    return walk()


def _category(text: str) -> int:
    lead = 0 if text[0] == " " else 1 if text[0] == "\n" else 2
    core = text.strip()
    kind = 0 if core.isalpha() else 1 if core.isdigit() else 2 if not core else 3
    return 1 + (lead * 4 + kind) * 2 + text.endswith("\n")


def no_categories() -> np.ndarray:
    """No vocabulary known: every context falls in one category."""
    a = np.zeros(0, dtype=np.uint8)
    a.flags.writeable = False
    return a


def identity_classes() -> np.ndarray:
    """No classes: canonical indexes would only repeat the real ones, so the proposer skips them."""
    a = np.zeros(0, dtype=np.int32)
    a.flags.writeable = False
    return a
