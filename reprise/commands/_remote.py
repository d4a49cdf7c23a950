"""What the operator commands (`reprise tenant`, `reprise index`) share: reaching a running server's
admin plane, naming tenants, progress bars, confirmations, JSON output and exit codes.

Exit codes: 0 done; 1 the server refused or failed the operation; 2 bad usage or input; 3 the server
cannot be reached; 4 the admin key is missing, wrong or lacks the role; 130 interrupted.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fileio import reprise_home
from reprise.arguments import CliError

if TYPE_CHECKING:
    from typing_extensions import Self

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH = 1, 2, 3, 4
_TENANT_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="the running service (default $REPRISE_SERVER, else 127.0.0.1:50051)")
    parser.add_argument("--admin-key", default=None, metavar="KEY",
                        help="admin key rpa_... (default $REPRISE_ADMIN_KEY, else the file "
                        "$REPRISE_HOME/admin.key that `reprise serve` wrote on first start)")
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --ca-file)")
    parser.add_argument("--ca-file", default=None, metavar="PEM", help="CA bundle that signed the server (implies --tls)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="give up on a call after S seconds (default 600)")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout (no progress bars)")


def admin_key(args: argparse.Namespace) -> str:
    if args.admin_key:
        return args.admin_key.strip()
    if os.environ.get("REPRISE_ADMIN_KEY"):
        return os.environ["REPRISE_ADMIN_KEY"].strip()
    path = reprise_home() / "admin.key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise CliError(f"no admin key: pass --admin-key, set REPRISE_ADMIN_KEY, or run on the server's host "
                       f"(it writes {path} on first start)", EXIT_AUTH) from None
    except PermissionError:
        raise CliError(f"cannot read {path}: permission denied (it is 0600, owned by the server's user)",
                       EXIT_AUTH) from None


def admin_client(args: argparse.Namespace) -> Any:
    from grpc_api.client import AdminClient

    target = args.server or os.environ.get("REPRISE_SERVER") or "127.0.0.1:50051"
    return AdminClient(target, admin_key(args), tls=bool(args.tls or args.ca_file),
                       root_certificates=args.ca_file, timeout=args.timeout)


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a client call; turn its RepriseError into a CliError with the right exit code."""
    import grpc

    from grpc_api.client import RepriseError

    try:
        return fn(*args, **kwargs)
    except RepriseError as exc:
        code = exc.code
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and "shutting down" not in exc.message:
            raise CliError(f"cannot reach the server ({code.name}: {exc.message}); is `reprise serve` running "
                           "there? (--server HOST:PORT)", EXIT_UNREACHABLE) from None
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise CliError(f"{exc.message} (check --admin-key)", EXIT_AUTH) from None
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            raise CliError(exc.message, EXIT_USAGE) from None
        raise CliError(f"{code.name.lower().replace('_', ' ')}: {exc.message}", EXIT_FAILED) from None


def resolve_tenant(client: Any, ref: str) -> tuple[str, str]:
    """(tenant id, name) of a tenant given by id or by name; an id is matched first (names cannot take an
    id's shape, but a store may hold names from before that rule)."""
    tenants = call(client.list_tenants)
    for t in [t for t in tenants if t.tenant_id == ref] or [t for t in tenants if t.name == ref]:
        return t.tenant_id, t.name
    kind = "id" if _TENANT_ID_RE.match(ref) else "name"
    raise CliError(f"no tenant with {kind} {ref!r} (`reprise tenant list` shows them)", EXIT_FAILED)


def emit_json(data: Any) -> None:
    def plain(x: Any) -> Any:
        if is_dataclass(x) and not isinstance(x, type):
            return asdict(x)
        if hasattr(x, "DESCRIPTOR"):
            from google.protobuf.json_format import MessageToDict

            return MessageToDict(x, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        raise TypeError(f"cannot serialize {type(x).__name__}")

    json.dump(data, sys.stdout, default=plain, indent=2)
    sys.stdout.write("\n")


class ProgressBar:
    """A tqdm bar on stderr when it is a terminal and output is not JSON; silent otherwise."""

    def __init__(self, args: argparse.Namespace, desc: str, unit: str = "", total: int | None = None) -> None:
        self._bar = None
        if not getattr(args, "json", False) and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(desc=desc, unit=unit or "it", total=total, file=sys.stderr, leave=False)

    def update(self, done: int, total: int = 0, phase: str = "", unit: str = "") -> None:
        if self._bar is None:
            return
        if total and self._bar.total != total:
            self._bar.total = total
        if phase:
            self._bar.set_description(phase, refresh=False)
        if unit:
            self._bar.unit = unit
        self._bar.n = done
        self._bar.refresh()

    def progress(self, p: Any) -> None:
        self.update(p.done, p.total, p.phase, p.unit)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def confirm(args: argparse.Namespace, what: str, expected: tuple[str, ...]) -> None:
    """A typed confirmation: ``--confirm VALUE`` or, on a terminal, the user types one of ``expected``."""
    given = getattr(args, "confirm", None)
    if given is None:
        if not sys.stdin.isatty():
            raise CliError(f"{what}: refusing without confirmation; pass --confirm {expected[0]}", EXIT_USAGE)
        print(f"{what}. This cannot be undone.", file=sys.stderr)
        try:
            given = input(f"Type {' or '.join(repr(e) for e in expected)} to go on: ").strip()
        except EOFError:
            given = ""
    if given not in expected:
        raise CliError(f"confirmation {given!r} does not match {expected[0]!r}; nothing was done", EXIT_USAGE)


def read_password(args: argparse.Namespace, twice: bool) -> str:
    """--password-file, else $REPRISE_EXPORT_PASSWORD, else a prompt on the terminal."""
    if getattr(args, "password_file", None):
        try:
            return Path(args.password_file).read_text().rstrip("\n")
        except OSError as exc:
            raise CliError(f"cannot read --password-file {args.password_file}: {exc.strerror}", EXIT_USAGE) from None
    if os.environ.get("REPRISE_EXPORT_PASSWORD"):
        return os.environ["REPRISE_EXPORT_PASSWORD"]
    if not sys.stdin.isatty():
        raise CliError("no password: pass --password-file or set REPRISE_EXPORT_PASSWORD", EXIT_USAGE)

    password = getpass.getpass("Export password: ")
    if twice and getpass.getpass("Again: ") != password:
        raise CliError("the passwords differ; nothing was done", EXIT_USAGE)
    if not password:
        raise CliError("the password is empty", EXIT_USAGE)
    return password
