"""A hostile client's floods against a real `reprise serve`, at full size, with what the service's other
users see meanwhile.

The benchmark starts `reprise serve` as a subprocess (its default limits, loopback, a temporary
$REPRISE_HOME; the default model, or --tiny's random Llama), creates a normal tenant and an attacker,
measures a quiet baseline, then runs each attack in turn:

    idle_streams     400 anonymous Health.Watch streams on 100 connections, held open
    reflection       400 anonymous reflection streams on 100 connections, held open
    half_open        4,000 HTTP connections that never finish their headers, from 20 addresses
    slow_body        200 requests that send their body a byte a second (slowloris on the body), held
                     until the server's body deadline (60 s by default) closes them
    huge_chats       three 15 MB chats of 30,000 messages at once, on HTTP, then on gRPC
    grammar          issue 22's grammar requests (ends before min_tokens, no token, allOf $ref #,
                     recursive required fields), 3 of each at once, on both fronts
    abandoned        rounds of streams opened to the tenant's limit and dropped mid-response
    append_flood     AppendTrajectory calls of 1,000 tokens each (a turn must fit the context), as fast
                     as three clients send them
    half_open_grpc   450 anonymous gRPC calls on one connection (Generate, GenerateStream, ListTenants,
                     ImportHistory) that send their headers and never their message
    half_open_waits  450 calls that may wait for their message on one connection (health Check without
                     a key, the attacker's own Generate), held until the message deadline ends them
    crafted_export   a 76-byte export asking for scrypt log2 n 20, r 16 (2 GiB), imported as an operator
                     would for a tenant's migration
    trace_bomb       `reprise replay` on a trace whose second line is 1.5 GB (1.5 MB of gzip); the
                     figures are the CLI process's (its peak RSS above its RSS before, its time)
    smuggling        a chat with both Content-Length and Transfer-Encoding and a request pipelined after
                     it, 50 times
    slots_flood      the attacker keeps 16 completions of 1,500 tokens (ignore_eos) running while another
                     tenant sends 20 8-token chats, one after another: their p95 against the same
                     tenant's 20 chats with the attacker idle (fair share of the slots)
    prefix_flood     another tenant's prompt of 1,884 words is cached; the attacker sends 14 distinct
                     prompts of the same length (--flood-prompts); what the other's next repeat finds
                     cached, and what the own engine's cache evicted meanwhile (fair share of the
                     prefix cache)

``--engine vllm`` runs them all on vLLM (its engine started by the server, as `reprise serve --engine
vllm` does).

Per attack it prints the attacker's outcome (what was refused, with which code, and whether a retry
delay came with it), the server's peak RSS during the attack (VmHWM, reset before each) above its
RSS before it, and, sampled all through the attack, the latency of /healthz, of gRPC health Check, of
the admin plane's ListTenants and of a normal tenant's request (gRPC Generate and HTTP chat in turn, 8
tokens): p50, p99 and how many failed. The quiet baseline's figures come first, as the anchor. Then,
on the quiet server, keep-alive latency: the median of 200 requests each on a fresh connection against
200 on one kept-alive connection (HTTP /healthz and /v1/models with ``http.client``; gRPC health
Check on a fresh channel against one reused channel).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpc_api.client import RepriseClient, RepriseError
from reprise.benchmarks import fair_share, hostile
from reprise.benchmarks.hostile import MiB, Served

if TYPE_CHECKING:
    from typing_extensions import Self

USER = [{"role": "user", "content": "hi"}]
GRAMMAR = [  # issue 22, items 1 and 2
    {"max_tokens": 40, "min_tokens": 30, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "boolean"}}}},
    {"max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "enum": []}}}},
    {"max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"allOf": [{"$ref": "#"}]}}}},
    {"max_tokens": 200, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
    {"max_tokens": 200, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
     "tool_choice": "required"},
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true",
                        help="serve a tiny random Llama instead of the default model (a quick run)")
    parser.add_argument("--model-path", default="", metavar="DIR", help="serve this model folder")
    parser.add_argument("--probe-seconds", type=float, default=6.0,
                        help="how long the held floods are sampled (default 6)")
    parser.add_argument("--only", default="", metavar="A,B", help="run only these attacks (comma-separated)")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                        help="the engine the server decodes with (default: Reprise's own)")
    parser.add_argument("--flood-prompts", type=int, default=14, metavar="N",
                        help="prefix_flood: the attacker's distinct prompts (default 14)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


# ---- the other users, sampled during an attack ----------------------------------------------------


class Probe:
    """/healthz, gRPC health Check and a normal tenant's request, sampled in turn until stopped."""

    def __init__(self, served: Served, key: str) -> None:
        self.served = served
        self.key = key
        self.times: dict[str, list[float]] = {"healthz": [], "grpc_health": [], "admin_call": [],
                                              "tenant_request": []}
        self.failed: dict[str, int] = dict.fromkeys(self.times, 0)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _record(self, name: str, ok: bool, seconds: float, what: str) -> None:
        if ok:
            self.times[name].append(seconds)
        else:
            self.failed[name] += 1
            if len(self.errors) < 5:
                self.errors.append(f"{name}: {what}"[:200])

    def _run(self) -> None:
        turn = 0
        while not self._stop.is_set():
            state, took = hostile.healthz(self.served.http, 10)
            self._record("healthz", state == "200 serving", took, state)
            state, took = hostile.grpc_health(self.served.grpc_target, 10)
            self._record("grpc_health", state == "SERVING", took, state)
            state, took = self.served.admin_call(10)
            self._record("admin_call", state == "ok", took, state)
            start = time.perf_counter()
            try:
                if turn % 2 == 0:
                    with RepriseClient(self.served.grpc_target, self.key) as client:
                        client.generate(text="hello", max_new_tokens=8, timeout=30)
                    ok, what = True, ""
                else:
                    status, _, doc = hostile.http_call(self.served.http, "POST", "/v1/chat/completions",
                                                       {"messages": USER, "max_tokens": 8}, key=self.key, timeout=30)
                    ok, what = status == 200, f"{status} {doc}"
            except Exception as exc:  # noqa: BLE001 - counted as a failure of the tenant's request
                ok, what = False, f"{type(exc).__name__}: {exc}"
            self._record("tenant_request", ok, time.perf_counter() - start, what)
            turn += 1
            self._stop.wait(0.05)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, values in self.times.items():
            out[name] = {"p50_ms": _ms(values, 0.5), "p99_ms": _ms(values, 0.99), "samples": len(values),
                         "failed": self.failed[name]}
        if self.errors:
            out["errors"] = self.errors
        return out


def _ms(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1) if ordered else None


# ---- the attacks ----------------------------------------------------------------------------------
# Each takes (served, attacker's key, hold) and returns its outcome; ``hold()`` returns once the
# probes have sampled long enough (floods that are held open wait for it before letting go).


def idle_streams(kind: str) -> Callable[[Served, str, Callable[[], None]], dict[str, Any]]:
    def attack(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
        streams = hostile.idle_streams(served.grpc_target, 400, per_channel=4, kind=kind)
        try:
            hold()
        finally:
            streams.close()
        return {"streams": 400, "held": streams.held, "refused": streams.refused,
                "refusals_with_retry_delay": streams.retry_hints}
    return attack


def half_open(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    hostile.raise_fd_limit()
    held = hostile.half_open(served.http, 4000, hostile.attacker_sources(20))
    try:
        open_after_connect = hostile.still_open(held)
        hold()
        open_after_hold = hostile.still_open(held)
    finally:
        hostile.close_all(held)
    return {"connections": 4000, "open_after_connect": open_after_connect, "open_after_probes": open_after_hold,
            "server_fds_after": served.num_fds()}


def slow_body(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n{")
    held = hostile.half_open(served.http, 200, hostile.attacker_sources(4), head=head)
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(1.0):
            for s in held:
                with contextlib.suppress(OSError):
                    s.setblocking(True)
                    s.settimeout(0.01)
                    s.send(b" ")

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    start = time.monotonic()
    try:
        hold()
        still = hostile.still_open(held)
        while hostile.still_open(held) and time.monotonic() - start < 90:  # past server.http_body_timeout_s
            time.sleep(1.0)
        closed_after = time.monotonic() - start
        left = hostile.still_open(held)
    finally:
        stop.set()
        dripper.join()
        hostile.close_all(held)
    return {"connections": 200, "open_after_probes": still, "open_at_end": left,
            "all_closed_after_s": round(closed_after, 1) if not left else None}


def huge_chats(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    body = hostile.huge_chat(30_000, 15_000_000)
    answers: list[str] = []

    def http_one() -> None:
        status, _, doc = hostile.http_call(served.http, "POST", "/v1/chat/completions", body, key=key, timeout=120)
        answers.append(f"HTTP {status} param={doc['error']['param'] if status >= 400 else None}")

    def grpc_one() -> None:
        try:
            with RepriseClient(served.grpc_target, key) as client:
                client.generate(messages=body["messages"], max_new_tokens=4, timeout=120)
            answers.append("gRPC OK")
        except RepriseError as exc:
            answers.append(f"gRPC {exc.code.name}")

    for fn in (http_one, grpc_one):
        threads = [threading.Thread(target=fn) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {"chats": 6, "each_bytes": len(json.dumps(body)), "answers": _tally(answers)}


def grammar(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    answers: list[str] = []

    def http_one(extra: dict) -> None:
        status, _, doc = hostile.http_call(served.http, "POST", "/v1/chat/completions", {"messages": USER, **extra},
                                           key=key, timeout=120)
        answers.append(f"HTTP {status}" + (f" param={doc['error']['param']}" if status >= 400 else
                                           f" {doc['choices'][0]['finish_reason']}"))

    def grpc_one(extra: dict) -> None:
        kwargs: dict[str, Any] = {"max_new_tokens": extra["max_tokens"], "min_new_tokens": extra.get("min_tokens", 0)}
        for name in ("response_format", "tools", "tool_choice"):
            if name in extra:
                kwargs[name] = extra[name]
        try:
            with RepriseClient(served.grpc_target, key) as client:
                answers.append(f"gRPC OK {client.generate(messages=USER, timeout=120, **kwargs).finish_reason}")
        except RepriseError as exc:
            answers.append(f"gRPC {exc.code.name}")

    threads = [threading.Thread(target=fn, args=(extra,)) for extra in GRAMMAR for fn in (http_one, grpc_one)
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": len(threads), "answers": _tally(answers)}


def abandoned(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    import http.client

    opened = 0
    for _ in range(5):
        conns = []
        for _ in range(16):
            conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=30)
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"messages": USER, "max_tokens": 500, "ignore_eos": True, "stream": True}),
                {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status == 200:
                opened += 1
            conns.append(conn)
        for conn in conns:
            conn.close()
    deadline = time.monotonic() + 30
    while served.metric("reprise_num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"streams_opened_and_dropped": opened, "running_after": served.metric("reprise_num_requests_running")}


def append_flood(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    answers: list[str] = []
    stop = threading.Event()

    def send() -> None:
        with RepriseClient(served.grpc_target, key) as client:
            while not stop.is_set():
                try:
                    client.append_trajectory("flood", tokens=[1 + i % 200 for i in range(1_000)])
                    answers.append("OK")
                except RepriseError as exc:
                    answers.append(exc.code.name + (" with retry delay" if exc.retry_after_s else ""))

    senders = [threading.Thread(target=send, daemon=True) for _ in range(3)]
    for t in senders:
        t.start()
    try:
        hold()
    finally:
        stop.set()
        for t in senders:
            t.join(60)
    return {"calls": len(answers), "tokens_each": 1_000, "answers": _tally(answers)}


HALF_OPEN_ANONYMOUS = ["/reprise.v1.DecodingService/Generate", "/reprise.v1.DecodingService/GenerateStream",
                       "/reprise.v1.AdminService/ListTenants", "/reprise.v1.AdminService/ImportHistory"]


def half_open_grpc(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    with hostile.HalfOpenCalls(served.grpc_target, HALF_OPEN_ANONYMOUS, 450) as calls:
        hold()
        return calls.outcome()


def half_open_waits(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    out = {}
    for name, method, who in (("health_check_anonymous", "/grpc.health.v1.Health/Check", None),
                              ("generate_attacker", "/reprise.v1.DecodingService/Generate", key)):
        with hostile.HalfOpenCalls(served.grpc_target, method, 450, key=who) as calls:
            hold()
            held_during_probes = calls.outcome()["held"]
            deadline = time.monotonic() + 30  # past server.grpc_message_timeout_s (10 s by default)
            while calls.outcome()["held"] and time.monotonic() < deadline:
                time.sleep(0.2)
            out[name] = {**calls.outcome(), "held_during_probes": held_during_probes}
    return out


def crafted_export(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    import io
    import struct

    from grpc_api.client import AdminClient
    from privacy.transfer import MAGIC

    data = MAGIC + struct.pack(">BBBB16s8s", 1, 20, 16, 1, b"s" * 16, b"n" * 8) + struct.pack(">I", 28) + b"\0" * 28
    start = time.perf_counter()
    try:
        with AdminClient(served.grpc_target, served.admin_key) as admin:
            admin.import_history(io.BytesIO(data), "correct horse battery staple", new_tenant_name="migrated")
        answer = "OK"
    except RepriseError as exc:
        answer = f"{exc.code.name}: {exc.message}"
    return {"file_bytes": len(data), "answer": answer[:200], "seconds": round(time.perf_counter() - start, 3)}


def trace_bomb(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="reprise-bomb-") as tmp:
        path = hostile.trace_bomb(Path(tmp) / "bomb.jsonl.gz", 1536 * MiB)
        size = path.stat().st_size
        run = hostile.run_cli("replay", str(path))
        # the anchor: the same command on a valid one-call trace (the bomb's first line)
        one = Path(tmp) / "one.jsonl"
        one.write_bytes(hostile.ONE_CALL_TRACE_LINE)
        anchor = hostile.run_cli("replay", str(one))
    message = next((line for line in run.stderr.splitlines() if "line longer" in line), run.stderr[-300:])
    return {"line_bytes": 1536 * MiB, "file_bytes": size, "exit_code": run.returncode, "message": message[:300],
            "seconds": round(run.seconds, 2), "cli_peak_rss_above_start_mb": round(run.peak_above_start / MiB),
            "anchor_one_call_trace": {"exit_code": anchor.returncode, "seconds": round(anchor.seconds, 2),
                                      "cli_peak_rss_above_start_mb": round(anchor.peak_above_start / MiB)}}


def smuggling(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
               + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
               + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n")
    answers: list[str] = []
    for _ in range(50):
        out = hostile.exchange(served.http_port, request)
        status = out.split(b"\r\n", 1)[0].decode(errors="replace")
        closed = "left open" if out.endswith(b"<open>") else "closed"
        smuggled = "answered" if b'"object":"list"' in out else "not read"
        answers.append(f"{status}, connection {closed}, smuggled request {smuggled}")
    return {"requests": 50, "answers": _tally(answers)}


def keep_alive(served: Served, tenant: str) -> dict[str, Any]:
    """Fresh against kept-alive connections on the quiet server (module docstring)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    out: dict[str, Any] = {}
    for name, path, key in (("http_healthz", "/healthz", None), ("http_models", "/v1/models", tenant)):
        figures = hostile.keepalive_latency(served.http, path, requests=200, key=key)
        out[name] = {k.removesuffix("_s").replace("p50", "p50_ms"): round(v * 1000, 2) for k, v in figures.items()}

    def check(ch: grpc.Channel) -> float:
        start = time.perf_counter()
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return time.perf_counter() - start

    fresh = []
    for _ in range(200):
        with hostile.channel(served.grpc_target) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)  # the connection, then the call alone
            fresh.append(check(ch))
    with hostile.channel(served.grpc_target) as ch:
        check(ch)
        kept = [check(ch) for _ in range(200)]
    out["grpc_health_check"] = {"fresh_p50_ms": _ms(fresh, 0.5), "kept_alive_p50_ms": _ms(kept, 0.5)}
    return out


def slots_flood(served: Served, key: str, hold: Callable[[], None]) -> dict[str, Any]:
    """Fair share of the slots: a new tenant's 20 chats with the attacker idle, then while the attacker
    keeps 16 maximal completions running (reprise/benchmarks/fair_share.py)."""
    victim = served.create_tenant(f"chatter-{time.monotonic_ns()}")
    fair_share.chat_latencies(served, victim, 3)  # warm, as an agent's repeated call is
    idle = fair_share.chat_latencies(served, victim, 20)
    with fair_share.Flood(served, key, num_requests=16, max_tokens=1500) as flood:
        running = flood.wait_running(16)
        during = fair_share.chat_latencies(served, victim, 20)
        health = fair_share.health_now(served)
    p95_idle, p95_during = fair_share.percentile(idle, 0.95), fair_share.percentile(during, 0.95)
    return {"attacker_requests_in_flight": 16 if running else "fewer than 16",
            "attacker_answers": _tally([str(a) for a in flood.answers]),
            "chat_p95_idle_s": round(p95_idle, 3), "chat_p95_during_s": round(p95_during, 3),
            "chat_p95_ratio": round(p95_during / p95_idle, 2), "health_during": list(health)}


def prefix_flood(served: Served, key: str, hold: Callable[[], None], num_prompts: int = 14,
                 num_words: int = 1884) -> dict[str, Any]:
    """Fair share of the prefix cache: a new tenant's prompt of ``num_words`` words (1,887 tokens with
    SmolLM2's tokenizer), cached, against the attacker's ``num_prompts`` distinct prompts of the same
    length (reprise/benchmarks/fair_share.py)."""
    victim = served.create_tenant(f"agent-{time.monotonic_ns()}")
    return fair_share.prefix_survival(served, key, victim, num_words=num_words, num_prompts=num_prompts)


def _sized(args: argparse.Namespace) -> dict[str, Callable[[Served, str, Callable[[], None]], dict[str, Any]]]:
    """The attacks with the sizes the command line gave (--tiny's byte tokens: shorter prompts)."""
    return {**ATTACKS, "prefix_flood": functools.partial(prefix_flood, num_prompts=args.flood_prompts,
                                                         num_words=200 if args.tiny else 1884)}


def _tally(answers: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in answers:
        out[a] = out.get(a, 0) + 1
    return out


ATTACKS: dict[str, Callable[[Served, str, Callable[[], None]], dict[str, Any]]] = {
    "idle_streams": idle_streams("watch"), "reflection": idle_streams("reflection"), "half_open": half_open,
    "slow_body": slow_body, "huge_chats": huge_chats, "grammar": grammar, "abandoned": abandoned,
    "append_flood": append_flood, "half_open_grpc": half_open_grpc, "half_open_waits": half_open_waits,
    "crafted_export": crafted_export, "trace_bomb": trace_bomb, "smuggling": smuggling,
    "slots_flood": slots_flood, "prefix_flood": prefix_flood,
}


# ---- running them ---------------------------------------------------------------------------------


def run_attack(served: Served, name: str, tenant: str, attacker: str, probe_seconds: float,
               attacks: dict[str, Callable[[Served, str, Callable[[], None]], dict[str, Any]]] = ATTACKS
               ) -> dict[str, Any]:
    rss_before = served.rss()
    served.reset_peak()
    start = time.perf_counter()
    with Probe(served, tenant) as probe:
        if name == "baseline":
            time.sleep(probe_seconds)
            outcome: dict[str, Any] = {}
        else:
            outcome = attacks[name](served, attacker, lambda: time.sleep(probe_seconds))
    return {"attack": name, "outcome": outcome, "seconds": round(time.perf_counter() - start, 1),
            "rss_before_mb": round(rss_before / MiB), "peak_rss_mb": round(served.peak_rss() / MiB),
            "peak_above_before_mb": round((served.peak_rss() - rss_before) / MiB), **probe.figures(),
            "server_alive": served.alive(), "after": _after(served, tenant)}


def _after(served: Served, key: str) -> str:
    seen = served.normal_requests(key)
    return "all served" if hostile.all_ok(seen) else json.dumps(seen)[:300]


def run(args: argparse.Namespace) -> int:
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        print(f"reprise bench attack: unknown attack {unknown[0]!r}; known: {', '.join(ATTACKS)}")
        return 2
    hostile.raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="reprise-attack-") as tmp:
        if args.model_path:
            model = Path(args.model_path)
        elif args.tiny:
            model = hostile.save_tiny_model(Path(tmp) / "tiny")
        else:  # converted once into this user's model cache, not into the server's temporary home
            from verifier.models import ensure_default_model

            model = ensure_default_model()
        # the model's own context and slots, not the tests' small ones
        flags = ("--model-max-len", "2048", "--model-num-slots", "8", "--engine", args.engine)
        # a real model (vLLM compiles first), maybe a busy host
        with Served.start(Path(tmp) / "home", model, *flags, timeout_s=900) as served:
            tenant, attacker = served.create_tenant("normal"), served.create_tenant("attacker")
            results = [run_attack(served, "baseline", tenant, attacker, args.probe_seconds)]
            latency = keep_alive(served, tenant)
            for name in names:
                results.append(run_attack(served, name, tenant, attacker, args.probe_seconds, _sized(args)))
            storm_lines = sum(1 for line in served.log().splitlines()
                              if "HTTP connections" in line or "gRPC calls" in line or "HTTP requests refused" in line)
            code = served.stop()
    report = {"model": str(args.model_path or ("tiny" if args.tiny else "default (SmolLM2-135M-Instruct)")),
              "attacks": results, "keep_alive": latency, "storm_log_lines": storm_lines, "server_exit_code": code,
              "load_average": _load()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0 if all(r["server_alive"] and r["after"] == "all served" for r in results) else 1


def _load() -> list[float]:
    with contextlib.suppress(OSError):
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    return []


def _print(report: dict[str, Any]) -> None:
    print(f"model: {report['model']}; load average {report['load_average']}")
    head = (f"{'attack':15} {'peak RSS':>14} {'healthz p50/p99':>17} {'gRPC health':>15} {'admin call':>15} "
            f"{'tenant req':>17}  after")
    print(head)
    for r in report["attacks"]:
        def lat(name: str, r: dict[str, Any] = r) -> str:
            f = r[name]
            fail = f" ({f['failed']} failed)" if f["failed"] else ""
            return f"{f['p50_ms']}/{f['p99_ms']}{fail}"
        print(f"{r['attack']:15} {r['peak_rss_mb']:>6} (+{r['peak_above_before_mb']:>4}) MB {lat('healthz'):>17} "
              f"{lat('grpc_health'):>15} {lat('admin_call'):>15} {lat('tenant_request'):>17}  {r['after']}")
        if r["outcome"]:
            print(f"{'':15} {json.dumps(r['outcome'])}")
        for error in r.get("errors", ()):
            print(f"{'':15} failed: {error}")
    print(f"keep-alive latency (quiet server), p50 fresh / kept alive: {json.dumps(report['keep_alive'])}")
    print(f"storm reports in the server log: {report['storm_log_lines']} lines; exit code {report['server_exit_code']}")


