"""`reprise tenant`: create, list, delete tenants and rotate their keys on a running server.

    reprise tenant create acme               # prints the tenant id and its API key (shown once)
    reprise tenant list [--json]
    reprise tenant delete acme               # crypto-shred; asks you to type the name (or --confirm acme)
    reprise tenant rotate-key acme           # new API key, the old ones stop working
    reprise tenant rotate-key acme --data-key        # re-encrypt the tenant's history under a new data key
    reprise tenant rotate-key --master-key           # re-wrap every data key under a new master key

Tenants are named by id or by name. The admin key comes from --admin-key, $REPRISE_ADMIN_KEY or the
server's $REPRISE_HOME/admin.key. Exit codes: 0 done, 1 refused or failed, 2 bad usage, 3 server
unreachable, 4 admin key missing or wrong.
"""

from __future__ import annotations

import argparse
import sys
import time

from reprise.arguments import CliError
from reprise.commands._remote import (
    ProgressBar,
    add_connection_arguments,
    admin_client,
    call,
    confirm,
    emit_json,
    resolve_tenant,
)


def add_parser(sub) -> None:
    parser = sub.add_parser("tenant", help="create, list, delete tenants and rotate their keys (admin)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    p = actions.add_parser("create", help="create a tenant and print its first API key")
    p.add_argument("name", help="1-63 letters, digits, '.', '_' or '-'")
    add_connection_arguments(p)
    p.set_defaults(func=run_create)

    p = actions.add_parser("list", help="list tenants")
    add_connection_arguments(p)
    p.set_defaults(func=run_list)

    p = actions.add_parser("delete", help="crypto-shred a tenant: its history becomes unreadable, then is deleted")
    p.add_argument("tenant", help="tenant id or name")
    p.add_argument("--confirm", metavar="TENANT", help="skip the prompt: repeat the tenant's name or id")
    p.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")
    add_connection_arguments(p)
    p.set_defaults(func=run_delete)

    p = actions.add_parser("rotate-key", help="rotate a tenant's API key or data key, or the master key")
    p.add_argument("tenant", nargs="?", help="tenant id or name (not with --master-key)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--data-key", action="store_true", help="rotate the tenant's data key (re-encrypts its records)")
    kind.add_argument("--master-key", action="store_true", help="rotate the master key (re-wraps every data key)")
    add_connection_arguments(p)
    p.set_defaults(func=run_rotate)

    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def run_create(args: argparse.Namespace) -> int:
    with admin_client(args) as client:
        tenant, key = call(client.create_tenant, args.name)
    if args.json:
        emit_json({"tenant_id": tenant.tenant_id, "name": tenant.name, "api_key": key})
    else:
        print(f"tenant  {tenant.name}  {tenant.tenant_id}")
        print(f"api key {key}")
        print("The API key is shown once and stored only as a hash: keep it now.", file=sys.stderr)
    return 0


def run_list(args: argparse.Namespace) -> int:
    with admin_client(args) as client:
        tenants = call(client.list_tenants)
    if args.json:
        emit_json([{"tenant_id": t.tenant_id, "name": t.name, "created_unix_ms": t.created_unix_ms} for t in tenants])
        return 0
    if not tenants:
        print("no tenants (create one: reprise tenant create NAME)", file=sys.stderr)
        return 0
    width = max(4, *(len(t.name) for t in tenants))
    print(f"{'name':<{width}}  {'tenant id':<32}  created")
    for t in tenants:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(t.created_unix_ms / 1000)) if t.created_unix_ms else "-"
        print(f"{t.name:<{width}}  {t.tenant_id:<32}  {created}")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    with admin_client(args) as client:
        tenant_id, name = resolve_tenant(client, args.tenant)
        if not args.dry_run:
            confirm(args, f"Deleting tenant {name} ({tenant_id}) destroys its data key and history", (name, tenant_id))
        num = call(client.delete_tenant, tenant_id, tenant_id, args.dry_run)
    if args.json:
        emit_json({"tenant_id": tenant_id, "name": name, "deleted": not args.dry_run, "num_records": num})
    elif args.dry_run:
        print(f"would delete tenant {name} ({tenant_id}) and its {num} records")
    else:
        print(f"deleted tenant {name} ({tenant_id}): data key destroyed, {num} records removed")
        print("Backups made before now still hold its sealed records: rotate the master key "
              "(reprise tenant rotate-key --master-key) to make them unreadable.", file=sys.stderr)
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    if args.master_key and args.tenant:
        raise CliError("--master-key rotates the key of every tenant: give no tenant", 2)
    if not args.master_key and not args.tenant:
        raise CliError("name the tenant whose key to rotate (or pass --master-key)", 2)
    kind = "master_key" if args.master_key else "data_key" if args.data_key else "api_key"
    with admin_client(args) as client:
        tenant_id, name = resolve_tenant(client, args.tenant) if args.tenant else ("", "")
        with ProgressBar(args, f"rotating {kind.replace('_', ' ')}") as bar:
            result = call(client.rotate_keys, kind, tenant_id, bar.progress)
    if args.json:
        emit_json({"kind": kind, "tenant_id": tenant_id, "api_key": result.api_key,
                   "key_version": result.key_version, "num_records": result.num_records})
    elif kind == "api_key":
        print(f"api key {result.api_key}")
        print(f"The previous keys of {name} no longer work. The new key is shown once: keep it now.", file=sys.stderr)
    elif kind == "data_key":
        print(f"tenant {name}: data key version {result.key_version}, {result.num_records} records re-encrypted")
    else:
        print(f"master key version {result.key_version}: {result.num_records} data keys re-wrapped")
    return 0
