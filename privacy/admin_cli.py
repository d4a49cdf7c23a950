"""Operator commands that work directly on the store (no server needed): ``python -m privacy ...``.

    python -m privacy admin-key create              # a new admin key, printed once
    python -m privacy tenant create NAME            # tenant id and its first API key, printed once
    python -m privacy tenant list [--json]
    python -m privacy tenant delete ID --confirm ID [--dry-run]
    python -m privacy keys status [--json]
    python -m privacy keys rotate-master            # re-wrap every data key, retire the old version
    python -m privacy keys rotate-data ID           # re-encrypt a tenant's records under a new data key
    python -m privacy export ID --out FILE (--password-env VAR | --key-file FILE)
    python -m privacy import FILE (--password-env VAR | --key-file FILE) [--name N | --into ID]
    python -m privacy verify [ID]                   # the SQLite file's pages, then every record; writes nothing
    python -m privacy repair [ID]                   # salvage a damaged SQLite file, then quarantine bad records

The store comes from the same settings as the service (``--backend``, ``--data-dir``, ``--redis-url``,
or ``REPRISE_STORE_*`` / ``REPRISE_HOME``); the master key from ``REPRISE_MASTER_KEY`` or the key file.
While a server runs on the same store, prefer its admin plane: it also evicts in-memory indexes.

``verify`` and ``repair`` are for a store the service cannot use (run them with the service stopped;
with it running, `reprise index verify|repair TENANT` does the record part through the admin plane).
On SQLite, ``verify`` first runs SQLite's integrity check of the whole file; ``repair`` copies every
readable row of a damaged file into a new one (``privacy.salvage``; the damaged file is kept beside it as
``history.db.damaged-<time>``). Both then open every record of every tenant (or of ID) with the master
key; ``repair`` moves those that fail authentication or parsing into the tenant's quarantine
(``privacy.integrity``). Each says what it found and dropped; ``verify`` exits 1 when anything is wrong.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import getpass
import json
import os
import sys
from pathlib import Path
from typing import Any

from privacy.bootstrap import open_store
from privacy.config import StoreConfig
from privacy.errors import PrivacyError
from privacy.salvage import check_sqlite, salvage_sqlite
from privacy.tenants import Progress, TenantId


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m privacy``."""
    parser = argparse.ArgumentParser(prog="python -m privacy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("sqlite", "redis"), help="store backend [env REPRISE_STORE_BACKEND]")
    parser.add_argument("--data-dir", type=Path, help="data directory [env REPRISE_STORE_DATA_DIR, REPRISE_HOME]")
    parser.add_argument("--redis-url", help="redis:// or rediss:// URL [env REPRISE_STORE_REDIS_URL]")
    sub = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)

    admin = sub.add_parser("admin-key", help="admin-plane keys").add_subparsers(dest="action", required=True)
    admin.add_parser("create", help="create an admin key and print it once")

    tenant = sub.add_parser("tenant", help="tenants").add_subparsers(dest="action", required=True)
    p = tenant.add_parser("create", help="create a tenant and print its first API key once")
    p.add_argument("name")
    p = tenant.add_parser("list", help="list tenants")
    p.add_argument("--json", action="store_true")
    p = tenant.add_parser("delete", help="crypto-shred a tenant: keys first, then records")
    p.add_argument("tenant_id")
    p.add_argument("--confirm", required=True, help="the tenant id again")
    p.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")

    keys = sub.add_parser("keys", help="master and data keys").add_subparsers(dest="action", required=True)
    p = keys.add_parser("status", help="key versions and encryption counts")
    p.add_argument("--json", action="store_true")
    p = keys.add_parser("rotate-master", help="re-wrap every data key under a new master key version")
    p.add_argument("--keep-old", action="store_true", help="do not retire the old master key version")
    p = keys.add_parser("rotate-data", help="re-encrypt a tenant's records under a new data key")
    p.add_argument("tenant_id")

    for name, text in (("export", "write a tenant's history to a sealed file"),
                       ("import", "read a sealed export file into a new or existing tenant")):
        p = sub.add_parser(name, help=text)
        if name == "export":
            p.add_argument("tenant_id")
            p.add_argument("--out", type=Path, required=True, help="file to write (must not exist)")
        else:
            p.add_argument("file", type=Path)
            target = p.add_mutually_exclusive_group()
            target.add_argument("--name", help="name of the new tenant (default: the exported name)")
            target.add_argument("--into", metavar="TENANT_ID", help="append to this existing tenant")
        secret = p.add_mutually_exclusive_group()
        secret.add_argument("--password-env", metavar="VAR", help="read the password from this environment variable")
        secret.add_argument("--key-file", type=Path, help="file holding a base64 256-bit key")

    for name, text in (("verify", "check the store's file and every record (or one tenant's); writes nothing"),
                       ("repair", "salvage a damaged SQLite file, then move bad records into quarantine")):
        p = sub.add_parser(name, help=text)
        p.add_argument("tenant_id", nargs="?", help="only this tenant's records (default: every tenant)")
        p.add_argument("--json", action="store_true", help="print the findings as JSON on stdout")
    return parser


def _config(args: argparse.Namespace, env: dict[str, str]) -> StoreConfig:
    settings: dict[str, Any] = {}
    for f in dataclasses.fields(StoreConfig):
        raw = env.get(f"REPRISE_STORE_{f.name.upper()}")
        if raw:
            settings[f.name] = raw.lower() in ("1", "true", "yes", "on") if f.type in ("bool",) else raw
    for name in ("backend", "data_dir", "redis_url"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    for name in ("max_encryptions_per_key", "chunk_bytes"):
        if name in settings:
            settings[name] = int(settings[name])
    return StoreConfig(**settings)


def _secret(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    if args.key_file is not None:
        try:
            return {"key": base64.b64decode(args.key_file.read_text().strip(), validate=True)}
        except (OSError, binascii.Error) as exc:
            raise ValueError(f"cannot read a base64 key from {args.key_file}: {exc}") from None
    if args.password_env is not None:
        if not env.get(args.password_env):
            raise ValueError(f"environment variable {args.password_env} is empty or unset")
        return {"password": env[args.password_env]}
    if not sys.stdin.isatty():
        raise ValueError("give --password-env VAR or --key-file FILE (no terminal to ask for a password)")
    return {"password": getpass.getpass("export password: ")}


def _progress(p: Progress) -> None:
    if sys.stderr.isatty():
        total = f"/{p.total}" if p.total else ""
        print(f"\r{p.phase}: {p.done}{total} {p.unit}", end="", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    """Run one parsed command against the store ``args``/``env`` name; returns the exit code."""
    env = dict(os.environ) if env is None else env
    if args.group in ("verify", "repair"):
        return check_store(_config(args, env), env, args.tenant_id, repair=args.group == "repair", as_json=args.json)
    store = open_store(_config(args, env), env=env)
    try:
        return _dispatch(store, args, env)
    finally:
        store.close()


def _dispatch(store: Any, args: argparse.Namespace, env: dict[str, str]) -> int:
    command = f"{args.group} {getattr(args, 'action', '')}".strip()
    if command == "admin-key create":
        key = store.create_admin_key()
        print(key.secret)
        print(f"admin key {key.key_id} created; it is shown only now", file=sys.stderr)
    elif command == "tenant create":
        tenant = store.create_tenant(args.name)
        key = store.create_api_key(tenant.id)
        print(json.dumps({"tenant_id": tenant.id.value, "name": tenant.name, "api_key": key.secret}))
        print("the API key is shown only now", file=sys.stderr)
    elif command == "tenant list":
        rows = [{"tenant_id": t.id.value, "name": t.name, "created_at": t.created_at,
                 "data_key_version": t.data_key_version} for t in store.list_tenants()]
        print(json.dumps(rows, indent=2) if args.json else "\n".join(f"{r['tenant_id']}  {r['name']}" for r in rows))
    elif command == "tenant delete":
        if args.confirm != args.tenant_id:
            raise ValueError(f"--confirm must repeat the tenant id {args.tenant_id!r}, got {args.confirm!r}")
        report = store.delete_tenant(TenantId(args.tenant_id), dry_run=args.dry_run)
        verb = "would delete" if args.dry_run else "crypto-shredded and deleted"
        print(f"tenant {args.tenant_id}: {verb} {report.num_records} records")
    elif command == "keys status":
        status = store.key_status()
        data = dataclasses.asdict(status)
        for t in data["tenants"]:
            t["tenant"] = t["tenant"]["value"]
        print(json.dumps(data, indent=2) if args.json else _status_text(data))
    elif command == "keys rotate-master":
        report = store.rotate_master_key(progress=_progress, retire_old=not args.keep_old)
        print(f"master key version {report.version}: {report.num_records} keys re-wrapped")
    elif command == "keys rotate-data":
        report = store.rotate_data_key(TenantId(args.tenant_id), progress=_progress)
        print(f"tenant {args.tenant_id}: data key version {report.version}, {report.num_records} records re-encrypted")
    elif command == "export":
        with os.fdopen(os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as sink:
            report = store.export_tenant(TenantId(args.tenant_id), sink, progress=_progress, **_secret(args, env))
        print(f"{args.out}: {report.num_trajectories} trajectories, {report.num_blobs} blobs, {report.num_bytes} bytes")
        for bad in report.skipped:
            print(f"left out {bad.describe()}", file=sys.stderr)
    elif command == "import":
        into = TenantId(args.into) if args.into else None
        with open(args.file, "rb") as source:
            report = store.import_tenant(source, into=into, name=args.name, progress=_progress, **_secret(args, env))
        print(f"tenant {report.tenant.id} ({report.tenant.name}): {report.num_trajectories} trajectories, "
              f"{report.num_blobs} blobs imported")
    return 0


def check_store(config: StoreConfig, env: dict[str, str], tenant: str | None, *, repair: bool,
                as_json: bool = False) -> int:
    """``verify`` / ``repair``: the file (SQLite), then the records; prints what it found and did. Exit 1
    when ``verify`` found anything wrong, or a tenant could not be checked at all."""
    out: dict[str, Any] = {"file": None, "tenants": []}
    failed = False
    if config.backend == "sqlite":
        path = config.sqlite.path
        problems = check_sqlite(path)
        out["file"] = {"path": str(path), "problems": problems}
        if problems and repair:
            report = salvage_sqlite(path)
            out["file"]["salvaged"] = dataclasses.asdict(report) | {"path": str(report.path), "kept": str(report.kept)}
        failed = bool(problems) and not repair
    store = open_store(config, env=env)
    try:
        ids = [TenantId(tenant).value] if tenant else store.storage.tenant_ids()
        for tid in ids:
            try:
                check = (store.repair_history if repair else store.verify_history)(TenantId(tid))
            except (PrivacyError, LookupError) as exc:
                out["tenants"].append({"tenant_id": tid, "error": str(exc)})
                failed = True
                continue
            failed |= bool(check.bad) and not repair
            out["tenants"].append({"tenant_id": tid, "num_records": check.num_records, "repaired": check.repaired,
                                   "num_quarantined": check.num_quarantined,
                                   "bad": [dataclasses.asdict(b) for b in check.bad]})
    finally:
        store.close()
    print(json.dumps(out, indent=2) if as_json else _check_text(out, repair))
    return 1 if failed else 0


def _check_text(out: dict[str, Any], repair: bool) -> str:
    lines = []
    f = out["file"]
    if f is not None:
        if not f["problems"]:
            lines.append(f"{f['path']}: sound (SQLite integrity check: ok)")
        else:
            n = len(f["problems"])
            lines.append(f"{f['path']}: damaged; SQLite's integrity check reports {n} problem{'s' * (n != 1)}:")
            lines += [f"  {p}" for p in f["problems"][:10]]
            salvaged = f.get("salvaged")
            if salvaged is None:
                lines.append("  `python -m privacy repair` copies every readable row into a new file")
            else:
                copied = sum(t["num_rows"] for t in salvaged["tables"])
                lines.append(f"salvaged {copied} rows into a new {salvaged['path']}; the damaged file is kept as "
                             f"{salvaged['kept']}")
                for t in salvaged["tables"]:
                    for after, upto in t["lost"]:
                        lines.append(f"  {t['table']}: rows with rowid in ({after}, {upto}] were unreadable and are "
                                     f"not in the new file")
    for t in out["tenants"]:
        if "error" in t:
            lines.append(f"tenant {t['tenant_id']}: cannot be checked: {t['error']}")
            continue
        kept = f"; {t['num_quarantined']} records in its quarantine" if t["num_quarantined"] else ""
        if not t["bad"]:
            lines.append(f"tenant {t['tenant_id']}: all {t['num_records']} records authenticate and parse{kept}")
            continue
        verb = "moved to quarantine" if repair else "fail their check"
        lines.append(f"tenant {t['tenant_id']}: {len(t['bad'])} of {t['num_records']} records {verb}{kept}:")
        for b in t["bad"]:
            where = f" (cursor {b['cursor']})" if b["cursor"] else ""
            lines.append(f"  {b['kind']} {b['record_id']}{where}: {b['reason']}")
    return "\n".join(lines)


def _status_text(data: dict[str, Any]) -> str:
    lines = [(f"master key versions {data['master_key_versions']} (primary {data['master_key_primary']}) from "
              f"{data['master_key_source']}; data keys retire after {data['max_encryptions_per_key']} encryptions")]
    for t in data["tenants"]:
        lines.append(f"{t['tenant']}  data key v{t['current']} (versions {t['versions']}), "
                     f"{t['encryptions']} encryptions, wrapped by master v{t['master_key_versions']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: errors become one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (PrivacyError, ValueError, OSError) as exc:
        print(f"python -m privacy: error: {exc}", file=sys.stderr)
        return 2
