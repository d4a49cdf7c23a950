"""The `reprise` command line.

Each subcommand lives in its own module under ``reprise.commands`` and exposes
``add_parser(subparsers) -> None`` (argument definitions only) and sets ``func=run`` on its parser; the
benchmarks (``reprise.benchmarks``) likewise. ``reprise --help`` imports every one of these modules, so
they import torch, transformers, grpc and the project modules that pull them in (the engine, the
service, the model loaders, the clients) inside the functions that run the command, never at module
top: that is what keeps ``reprise --help`` fast. Errors the user can fix are ``CliError``
(``reprise.arguments``): one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from reprise.arguments import CliError
from reprise.commands import bench, index, replay, serve, tenant, train_drafter, tune

# Order is the order shown by --help.
COMMAND_MODULES = (serve, replay, tune, bench, tenant, index, train_drafter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reprise",
        description="Reprise: speculative decoding service for AI agents. Drafts from each tenant's past "
        "trajectories (suffix tree, exact keys), verifies with the target model, output identical to it.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
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
    except BrokenPipeError:  # the reader went away (`reprise index stats | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
