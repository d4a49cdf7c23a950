"""What the commands and the benchmarks share on the command line: the error they report and the checks
of their arguments. Light by design: ``reprise --help`` imports it with every command module.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable


class CliError(Exception):
    """An error to report on stderr with a non-zero exit code and no traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def positive_int(text: str) -> int:
    """argparse type of counts and sizes: an integer >= 1, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def require_at_least(args: argparse.Namespace, names: Iterable[str], minimum: int = 1) -> None:
    """``CliError`` naming the flag and its value when one of the ``names`` attributes of ``args`` is
    below ``minimum`` (for counts that a caller may also set without the parser)."""
    for name in names:
        value = getattr(args, name)
        if value < minimum:
            raise CliError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type of lists of sizes (``"1,2,4"``): integers >= 1, ascending and distinct."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return tuple(values)
