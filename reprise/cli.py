"""The `reprise` command line.

Each subcommand lives in its own module under ``reprise.commands`` and exposes
``add_parser(subparsers) -> None`` (argument definitions only, no heavy imports) and sets
``func=run`` on its parser. Heavy imports (torch, grpc, transformers) happen inside ``run`` so that
``reprise --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Order is the order shown by --help.
COMMAND_MODULES = (
    "serve",
    "replay",
    "tune",
    "bench",
    "tenant",
    "index",
    "train_drafter",
)


def positive_int(text: str) -> int:
    """argparse type of counts and sizes: an integer >= 1, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


class CliError(Exception):
    """An error to report on stderr with a non-zero exit code and no traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reprise",
        description="Reprise: speculative decoding service for AI agents. Drafts from each tenant's past "
        "trajectories (suffix tree, exact keys), verifies with the target model, output identical to it.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"reprise.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"reprise.commands.{name}":
                continue  # not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"reprise {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"reprise {args.command}: interrupted", file=sys.stderr)
        return 130
