"""`reprise index`: per-tenant drafting indexes on a running server.

    reprise index stats [TENANT] [--json]    # index size, hit rate, tau, acceptance by position, drafter mix, KV cache,
                                             # speedup and seconds saved, memory against the budget, evictions,
                                             # quarantined records
    reprise index build TENANT               # rebuild the in-memory index from the encrypted history
    reprise index compact TENANT             # rewrite the stored history and snapshot compactly
    reprise index verify TENANT              # name the stored records that fail authentication or parsing
    reprise index repair TENANT              # move those into the tenant's quarantine, rebuild the index
    reprise index import-corpus TENANT FILE...   # documents that draft REST-style for this tenant
    reprise index export TENANT --out FILE   # the tenant's history as a password-sealed file
    reprise index import FILE [--name NEW | --into TENANT]

A record that fails authentication or parsing is skipped (quarantined) when an index is built and
left out of an export; both say so. `verify` and `repair` name it; repair keeps its stored bytes aside
in the tenant's quarantine (never deleted silently). For a store the service cannot open, the offline
form works on the store directly: `python -m privacy verify|repair`.

import-corpus reads plain text files (one document each) or .jsonl files with one {"text": ...} or
{"token_ids": [...]} object per line. Passwords come from --password-file, $REPRISE_EXPORT_PASSWORD or
a prompt. Exit codes: 0 done, 1 refused or failed (verify: bad records found), 2 bad usage, 3 server
unreachable, 4 admin key missing or wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fileio.lines import bounded_lines
from reprise.arguments import CliError
from reprise.commands._remote import (
    ProgressBar,
    add_connection_arguments,
    admin_client,
    call,
    emit_json,
    read_password,
    resolve_tenant,
)

# A .jsonl corpus line: one document, which must fit in one gRPC message (server.max_message_bytes, 16 MiB
# by default) once decoded; its JSON text may be a few times longer (escapes). Longer lines are refused
# without being read whole.
MAX_CORPUS_LINE_BYTES = 64 << 20


def add_parser(sub) -> None:
    parser = sub.add_parser("index", help="per-tenant index statistics, build, compact, verify, repair, corpus, "
                            "export (admin)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    p = actions.add_parser("stats", help="index size, hit rate, tau, acceptance by position, drafter mix, speedup and time saved")
    p.add_argument("tenant", nargs="?", help="tenant id or name (default: every tenant)")
    add_connection_arguments(p)
    p.set_defaults(func=run_stats)

    for name, text in (("build", "rebuild a tenant's index from its encrypted history"),
                       ("compact", "rewrite a tenant's stored history and index snapshot compactly")):
        p = actions.add_parser(name, help=text)
        p.add_argument("tenant", help="tenant id or name")
        add_connection_arguments(p)
        p.set_defaults(func=run_index_op, op=name)

    for name, text in (("verify", "name a tenant's stored records that fail authentication or parsing"),
                       ("repair", "move a tenant's bad records into its quarantine and rebuild its index")):
        p = actions.add_parser(name, help=text)
        p.add_argument("tenant", help="tenant id or name")
        add_connection_arguments(p)
        p.set_defaults(func=run_history_check, op=name)

    p = actions.add_parser("import-corpus", help="upload documents that draft for one tenant (REST-style)")
    p.add_argument("tenant", help="tenant id or name")
    p.add_argument("files", nargs="+", metavar="FILE", help="text files (one document each) or .jsonl files")
    p.add_argument("--replace", action="store_true", help="drop the tenant's current corpus first")
    add_connection_arguments(p)
    p.set_defaults(func=run_import_corpus)

    p = actions.add_parser("export", help="write a tenant's history to a password-sealed file")
    p.add_argument("tenant", help="tenant id or name")
    p.add_argument("--out", required=True, metavar="FILE", help="file to write (refuses to overwrite)")
    p.add_argument("--password-file", metavar="FILE", help="read the password from FILE")
    add_connection_arguments(p)
    p.set_defaults(func=run_export)

    p = actions.add_parser("import", help="load an export file into a new tenant or append it to one")
    p.add_argument("file", help="an export file")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--name", default="", help="name of the new tenant (default: the exported name)")
    target.add_argument("--into", default="", metavar="TENANT", help="append to this existing tenant")
    p.add_argument("--password-file", metavar="FILE", help="read the password from FILE")
    add_connection_arguments(p)
    p.set_defaults(func=run_import)

    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _stats_dict(s: Any, name: str = "") -> dict[str, Any]:
    return {"name": name, **asdict(s)}


def run_stats(args: argparse.Namespace) -> int:
    with admin_client(args) as client:
        names = {t.tenant_id: t.name for t in call(client.list_tenants)}
        tenant_id = resolve_tenant(client, args.tenant)[0] if args.tenant else None
        stats, memory = call(client.index_stats_and_memory, tenant_id)
    if args.json:
        emit_json({"tenants": [_stats_dict(s, names.get(s.tenant_id, "")) for s in stats], "memory": memory})
        return 0
    if not stats:
        print("no tenants", file=sys.stderr)
        return 0
    width = max(6, *(len(names.get(s.tenant_id, s.tenant_id[:8])) for s in stats))
    print(f"{'tenant':<{width}} {'requests':>9} {'steps':>9} {'hit rate':>9} {'tau':>6} {'accept':>7} "
          f"{'index tok':>10} {'memory':>9} {'corpus tok':>10} {'KV cache':>9} {'cached':>7} {'bad':>4} {'speedup':>8} "
          f"{'saved s':>9}  drafter mix")
    for s in stats:
        accept = s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0
        mix = ", ".join(f"{k} {v}" for k, v in sorted(s.drafter_steps.items(), key=lambda kv: -kv[1])) or "-"
        held = _bytes(s.index_memory_bytes) if s.index_resident else "on disk"
        print(f"{names.get(s.tenant_id, s.tenant_id[:8]):<{width}} {s.num_requests:>9} {s.num_steps:>9} "
              f"{s.hit_rate:>8.1%} {s.tau:>6.2f} {accept:>6.1%} {s.index_tokens:>10} "
              f"{held:>9} {s.corpus_tokens:>10} {_bytes(s.prefix_cache_bytes):>9} "
              f"{s.prefix_cache_hit_rate:>6.1%} {s.quarantined_records:>4} {_speedup(s.speedup):>8} {s.seconds_saved:>9.1f}  {mix}")
    since = min(s.counting_since_unix_ms for s in stats)
    if since:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since / 1000))
        print(f"requests through drafter mix count since {started} (the server's start; the index persists)")
    if len(stats) == 1 and stats[0].speedup is not None:
        s = stats[0]
        print(f"time saved  {s.seconds_saved:.1f} s of an estimated {s.plain_seconds:.1f} s without Reprise "
              f"(drafts {s.seconds_saved_drafts:.1f} s, prefix cache {s.seconds_saved_cache:.1f} s); "
              f"{s.tokens_per_second or 0.0:.1f} tokens/s delivered")
    if len(stats) == 1 and (stats[0].holdout_requests or stats[0].measured_speedup is not None):
        s = stats[0]
        measured = ("not yet (two of each are needed)" if s.measured_speedup is None else
                    f"{s.measured_speedup:.2f}x (95 % interval {s.measured_speedup_low:.2f}x-"
                    f"{s.measured_speedup_high:.2f}x)")
        print(f"speedup measured on held-out requests  {measured}: {s.holdout_requests} decoded without drafts, "
              f"{s.drafted_requests} with (server.holdout_share)")
    if len(stats) == 1 and stats[0].acceptance_by_position:
        shown = ", ".join(f"{i + 1}: {a:.0%}" for i, a in enumerate(stats[0].acceptance_by_position[:16]))
        print(f"acceptance by position  {shown}")
    budget = _bytes(memory.budget_bytes) if memory.budget_bytes else "no limit"
    print(f"index memory {_bytes(memory.resident_bytes)} of {budget} ({memory.resident_tenants} tenants in memory; "
          f"{memory.num_evictions} evictions since start, rebuilt from history on next use)")
    if memory.quarantined_records:
        print(f"{memory.quarantined_records} stored records failed authentication or parsing and were skipped "
              f"(column 'bad'); `reprise index verify TENANT` names them, `reprise index repair TENANT` sets them aside")
    return 0


def _speedup(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def run_index_op(args: argparse.Namespace) -> int:
    with admin_client(args) as client:
        tenant_id, name = resolve_tenant(client, args.tenant)
        fn = client.build_index if args.op == "build" else client.compact_index
        with ProgressBar(args, f"{args.op} {name}") as bar:
            stats, seconds = call(fn, tenant_id, bar.progress)
    if args.json:
        emit_json({**_stats_dict(stats, name), "seconds": seconds})
    else:
        verb = "built" if args.op == "build" else "compacted"
        print(f"{verb} the index of {name} in {seconds:.2f} s: {stats.index_tokens} tokens, "
              f"{stats.index_sequences} trajectories, {_bytes(stats.index_memory_bytes)}")
        if stats.quarantined_records:
            print(f"skipped {stats.quarantined_records} stored records that failed authentication or parsing "
                  f"(quarantined); `reprise index verify {name}` names them, `reprise index repair {name}` "
                  f"sets them aside", file=sys.stderr)
    return 0


def run_history_check(args: argparse.Namespace) -> int:
    with admin_client(args) as client:
        tenant_id, name = resolve_tenant(client, args.tenant)
        fn = client.verify_history if args.op == "verify" else client.repair_history
        with ProgressBar(args, f"{args.op} {name}") as bar:
            check = call(fn, tenant_id, bar.progress)
    if args.json:
        emit_json({"name": name, **asdict(check)})
        return 0
    print(describe_check(check, name))
    return 1 if args.op == "verify" and check.bad else 0


def describe_check(check: Any, name: str) -> str:
    """What a verify or repair found and did, one line per bad record."""
    lines = [f"  {b.kind} {b.record_id}" + (f" (cursor {b.cursor})" if b.cursor else "") + f": {b.reason}"
             for b in check.bad]
    kept = f"{check.num_quarantined} records kept in its quarantine"
    if not check.bad:
        head = f"{name}: all {check.num_records} stored records authenticate and parse"
        return head + (f"; {kept}" if check.num_quarantined else "")
    if check.repaired:
        head = (f"{name}: dropped {len(check.bad)} of {check.num_records} records from the history (moved unchanged "
                f"to its quarantine: {kept}); its index was rebuilt from the rest:")
    else:
        head = (f"{name}: {len(check.bad)} of {check.num_records} stored records fail their check "
                f"(`reprise index repair {name}` sets them aside):")
    return "\n".join([head, *lines])


def read_documents(paths: list[str]) -> Iterator[str | list[int]]:
    """Documents from text files (one each) and .jsonl files (one per line, each at most
    ``MAX_CORPUS_LINE_BYTES``, never read whole beyond that); errors name file and line."""
    for name in paths:
        path = Path(name)
        try:
            if path.suffix != ".jsonl":
                yield path.read_text(encoding="utf-8")
                continue
            with path.open("rb") as f:
                for lineno, raw in enumerate(bounded_lines(f, MAX_CORPUS_LINE_BYTES), 1):
                    if raw is None:
                        raise CliError(f"{path}:{lineno}: line longer than {MAX_CORPUS_LINE_BYTES} bytes (a document "
                                       "must fit in one gRPC message, server.max_message_bytes): split it", 2)
                    line = raw.decode("utf-8")
                    if not line.strip():
                        continue
                    try:
                        doc = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise CliError(f"{path}:{lineno}: not JSON ({exc.msg})", 2) from None
                    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
                        yield doc["text"]
                    elif isinstance(doc, dict) and isinstance(doc.get("token_ids"), list) and all(
                            isinstance(t, int) for t in doc["token_ids"]):
                        yield doc["token_ids"]
                    else:
                        raise CliError(f'{path}:{lineno}: expected {{"text": "..."}} or {{"token_ids": [...]}}', 2)
        except OSError as exc:
            raise CliError(f"cannot read {path}: {exc.strerror}", 2) from None
        except UnicodeDecodeError:
            raise CliError(f"{path} is not UTF-8 text", 2) from None


def run_import_corpus(args: argparse.Namespace) -> int:
    # Every file is read and checked before the upload starts: a missing or malformed file is one line
    # naming it (exit 2), not an upload broken off halfway. The upload then reads the files again.
    for _ in read_documents(args.files):
        pass
    with admin_client(args) as client:
        tenant_id, name = resolve_tenant(client, args.tenant)
        with ProgressBar(args, f"uploading to {name}", "doc") as bar:
            result = call(client.import_corpus, tenant_id, read_documents(args.files), args.replace,
                          lambda n: bar.update(n))
    if args.json:
        emit_json({"tenant_id": tenant_id, "name": name, "num_documents": result.num_documents,
                   "num_tokens": result.num_tokens, "corpus_tokens": result.corpus_tokens})
    else:
        print(f"imported {result.num_documents} documents ({result.num_tokens} tokens) for {name}; "
              f"its corpus now holds {result.corpus_tokens} tokens")
    return 0


def run_export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        raise CliError(f"{out} exists; choose another --out (exports never overwrite)", 2)
    with admin_client(args) as client:
        tenant_id, name = resolve_tenant(client, args.tenant)
        password = read_password(args, twice=True)
        partial = out.with_name(out.name + ".partial")
        try:
            with partial.open("xb") as f, ProgressBar(args, f"exporting {name}") as bar:
                summary = call(client.export_history, tenant_id, f, password, bar.progress)
            partial.rename(out)  # only a complete export gets the name asked for
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    if args.json:
        emit_json({"tenant_id": tenant_id, "name": name, "file": str(out), "bytes": summary.num_bytes,
                   "num_trajectories": summary.num_trajectories, "skipped": summary.skipped})
    else:
        print(f"exported {name} to {out} ({summary.num_bytes} bytes, sealed with the password)")
        if summary.skipped:
            print(f"left out {len(summary.skipped)} stored records that failed authentication or parsing:",
                  file=sys.stderr)
            for b in summary.skipped:
                where = f" (cursor {b.cursor})" if b.cursor else ""
                print(f"  {b.kind} {b.record_id}{where}: {b.reason}", file=sys.stderr)
    return 0


def run_import(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise CliError(f"no such file: {path}", 2)
    with admin_client(args) as client:
        into = resolve_tenant(client, args.into)[0] if args.into else ""
        password = read_password(args, twice=False)
        with path.open("rb") as f, ProgressBar(args, "uploading", "B", path.stat().st_size) as bar:
            reply = call(client.import_history, f, password, new_tenant_name=args.name, into_tenant_id=into,
                         on_bytes=lambda n: bar.update(n))
    if args.json:
        emit_json({"tenant_id": reply.tenant.tenant_id, "name": reply.tenant.name, "created": reply.created,
                   "num_trajectories": reply.num_trajectories, "num_blobs": reply.num_blobs,
                   "api_key": reply.api_key})
    else:
        where = "new tenant" if reply.created else "tenant"
        print(f"imported {reply.num_trajectories} trajectories and {reply.num_blobs} blobs into {where} "
              f"{reply.tenant.name} ({reply.tenant.tenant_id})")
        if reply.api_key:
            print(f"api key {reply.api_key}")
            print("The API key is shown once: keep it now.", file=sys.stderr)
    return 0
