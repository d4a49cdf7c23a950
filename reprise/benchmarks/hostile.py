"""A real `reprise serve` in a subprocess, and what a hostile client does to it from outside, shared by
`reprise bench attack` (reprise/benchmarks/attack.py) and the hostile-client tests (tests/hostile).

    with Served.start(home, model_dir, "--http-header-timeout-s", "2") as served:
        key = served.create_tenant("acme")
        served.reset_peak()                      # the process's peak RSS (VmHWM) starts again from now
        status, headers, doc = http_call(served.http, "POST", "/v1/chat/completions", body, key=key)
        assert served.normal_requests(key) == {...}   # a tenant on both APIs, and health on both

Everything is loopback. HTTP calls may leave from another loopback address (``source``, 127.0.0.2 ...)
so that an attacker and a normal tenant count as different clients of the server's per-address caps;
gRPC channels never share a connection (``grpc.use_local_subchannel_pool``), so each one is one
HTTP/2 connection with its own per-connection caps.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpc_api.client import AdminClient, RepriseClient

if TYPE_CHECKING:
    from typing_extensions import Self

START_TIMEOUT_S = 180.0
MiB = 1 << 20
PLANES = ("reprise.v1.DecodingService", "reprise.v1.AdminService")
NORMAL_CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_tiny_model(folder: Path) -> Path:
    """A tiny random Llama with the byte-level tokenizer (reprise/offline/tiny.py) saved where `reprise
    serve --model-path` reads it: steps take milliseconds, tokenization and templates are real."""
    from reprise.offline.tiny import byte_level_tokenizer, tiny_llama

    if not (folder / "config.json").exists():
        tiny_llama().save_pretrained(folder)
        byte_level_tokenizer(tool_template=True).save_pretrained(folder)
    return folder


def raise_fd_limit() -> int:
    """This process's soft limit on open files raised to its hard limit (floods hold thousands)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _proc_status(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@dataclass
class Served:
    """A running `reprise serve` process (``Served.start``); ``stop()`` ends it with SIGTERM."""

    proc: subprocess.Popen
    home: Path
    grpc_target: str
    http: str
    http_port: int
    admin_key: str
    log_path: Path

    @classmethod
    def start(cls, home: Path, model_dir: Path | None, *flags: str, timeout_s: float = START_TIMEOUT_S) -> Served:
        """`reprise serve` on free loopback ports with its data in ``home``, serving ``model_dir`` (None:
        the default model), with ``flags`` added; returns once both fronts answer."""
        grpc_port, http_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k != "REPRISE_MASTER_KEY"}
        env.update(REPRISE_HOME=str(home), REPRISE_SERVER=f"127.0.0.1:{grpc_port}", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        home.mkdir(parents=True, exist_ok=True)
        log_path = home.parent / f"{home.name}.serve.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "reprise", "serve", *(("--model-path", str(model_dir)) if model_dir else ()),
                 "--grpc-port",
                 str(grpc_port), "--http-port", str(http_port), "--model-max-len", "1024", "--model-num-slots", "4",
                 "--grace-seconds", "2", "--stats-interval-s", "60", *flags],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        served = cls(proc, home, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", http_port, "", log_path)
        deadline = time.monotonic() + timeout_s
        try:
            while "serving gRPC" not in served.log() or not healthz(served.http, 2)[0].startswith("200"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"`reprise serve` did not start:\n{served.log()[-3000:]}")
                time.sleep(0.1)
            served.admin_key = (home / "admin.key").read_text().strip()
        except BaseException:
            served.stop()
            raise
        return served

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 20 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    # ---- the process seen from outside -------------------------------------------------------------

    def rss(self) -> int:
        return _proc_status(self.pid, "VmRSS")

    def peak_rss(self) -> int:
        """Peak resident memory since start or since ``reset_peak``."""
        return _proc_status(self.pid, "VmHWM")

    def reset_peak(self) -> None:
        """Start the peak (VmHWM) again from the current RSS (Linux: ``clear_refs`` 5)."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def num_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on /metrics (read with the admin key)."""
        status, _, text = http_call(self.http, "GET", "/metrics", key=self.admin_key)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text}")
        return sum(float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines()
                   if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))

    # ---- as a tenant -------------------------------------------------------------------------------

    def create_tenant(self, name: str) -> str:
        """A new tenant's API key."""
        with AdminClient(self.grpc_target, self.admin_key) as admin:
            return admin.create_tenant(name)[1]

    def normal_requests(self, key: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """What a normal tenant and a load balancer see now: gRPC Generate, HTTP chat, gRPC health Check,
        /healthz; each ``ok`` with its latency in seconds, or the error."""
        out: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            with RepriseClient(self.grpc_target, key) as client:
                done = client.generate(text="hello", max_new_tokens=4, timeout=timeout_s)
            out["grpc_generate"] = ("ok" if done.completion_tokens >= 1 else "empty", time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - reported, the caller asserts
            out["grpc_generate"] = (f"{type(exc).__name__}: {exc}"[:300], time.perf_counter() - start)
        start = time.perf_counter()
        try:
            status, _, doc = http_call(self.http, "POST", "/v1/chat/completions", NORMAL_CHAT, key=key, timeout=timeout_s)
            good = status == 200 and doc["choices"][0]["finish_reason"] in ("length", "stop")
            out["http_chat"] = ("ok" if good else f"{status} {doc}"[:300], time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001
            out["http_chat"] = (f"{type(exc).__name__}: {exc}"[:300], time.perf_counter() - start)
        out["grpc_health"] = grpc_health(self.grpc_target, timeout_s)
        out["healthz"] = healthz(self.http, timeout_s)
        out["admin_list_tenants"] = self.admin_call(timeout_s)
        for plane in PLANES:  # both fronts' health of each plane, which must agree
            out[f"health {plane}"] = (grpc_health(self.grpc_target, timeout_s, plane)[0],
                                      healthz(self.http, timeout_s, service=plane)[0])
        return out

    def admin_call(self, timeout_s: float = 30.0) -> tuple[str, float]:
        """(``"ok"`` or the error, seconds) of the admin plane's ListTenants on a fresh connection."""
        start = time.perf_counter()
        try:
            with AdminClient(self.grpc_target, self.admin_key, timeout=timeout_s) as admin:
                admin.list_tenants()
            return "ok", time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - reported, the caller asserts
            return f"{type(exc).__name__}: {exc}"[:300], time.perf_counter() - start


def all_ok(seen: dict[str, Any]) -> bool:
    """Every check of ``Served.normal_requests`` answered as a healthy service would."""
    return (seen["grpc_generate"][0] == "ok" and seen["http_chat"][0] == "ok" and seen["grpc_health"][0] == "SERVING"
            and seen["healthz"][0] == "200 serving" and seen["admin_list_tenants"][0] == "ok"
            and all(seen[f"health {plane}"] == ("SERVING", "200 serving") for plane in PLANES))


# ---- the two fronts, as any client --------------------------------------------------------------------


def http_call(base: str, method: str, path: str, body: Any = None, *, key: str | None = None,
              raw: bytes | None = None, source: str = "127.0.0.1", timeout: float = 30.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """One request on a fresh connection from ``source``: (status, headers, JSON body or text)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout, source_address=(source, 0))
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json", **(headers or {})}
        if key:
            h["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=h)
        resp = conn.getresponse()
        text = resp.read()
        out_headers = {k.lower(): v for k, v in resp.getheaders()}
        try:
            doc: Any = json.loads(text)
        except ValueError:
            doc = text.decode(errors="replace")
        return resp.status, out_headers, doc
    finally:
        conn.close()


def keepalive_latency(base: str, path: str = "/healthz", requests: int = 40, key: str | None = None,
                      body: Any = None) -> dict[str, float]:
    """Median seconds of ``requests`` requests each on a fresh connection, and of as many on one kept-alive
    connection (the first request on it not counted), from 127.0.0.1, whatever the answers' statuses:
    what a client that keeps its connections waits for each answer beyond the server's work. The client
    is ``http.client``, which writes a request's head and body in two sends with Nagle's algorithm on."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    method = "GET" if body is None else "POST"
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def one(conn: http.client.HTTPConnection) -> float:
        start = time.perf_counter()
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        response.read()
        return time.perf_counter() - start

    fresh = []
    for _ in range(requests):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            fresh.append(one(conn))
        finally:
            conn.close()
    kept = []
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        one(conn)
        kept = [one(conn) for _ in range(requests)]
    finally:
        conn.close()
    return {"fresh_p50_s": sorted(fresh)[len(fresh) // 2], "kept_alive_p50_s": sorted(kept)[len(kept) // 2]}


def healthz(base: str, timeout: float = 10.0, source: str = "127.0.0.1", service: str = "") -> tuple[str, float]:
    """(``"<status> <body>"``, seconds) of GET /healthz (of one plane: ``service``), or the error."""
    start = time.perf_counter()
    try:
        path = "/healthz" + (f"?service={service}" if service else "")
        status, _, text = http_call(base, "GET", path, source=source, timeout=timeout)
        return f"{status} {str(text).strip()}", time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:200], time.perf_counter() - start


def channel(target: str, **options: Any) -> grpc.Channel:
    """A channel on its own connection (no subchannel shared with other channels)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1), *options.items()])


def grpc_health(target: str, timeout: float = 10.0, service: str = "") -> tuple[str, float]:
    """(status name, seconds) of grpc.health.v1 Check (of ``service``) on a fresh connection, or the
    error's code."""
    start = time.perf_counter()
    with channel(target) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), time.perf_counter() - start
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"[:200], time.perf_counter() - start


# ---- floods ---------------------------------------------------------------------------------------


def attacker_sources(n: int) -> list[str]:
    """``n`` loopback addresses other than 127.0.0.1 (the normal tenant's)."""
    return [f"127.0.{1 + i // 250}.{2 + i % 250}" for i in range(n)]


def half_open(base: str, count: int, sources: list[str],
              head: bytes = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") -> list[socket.socket]:
    """``count`` connections that send the start of a request and never finish its headers, spread over
    ``sources``; the sockets the server has not (yet) closed. Connections refused at once are dropped."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    held = []
    for i in range(count):
        s = socket.socket()
        try:
            s.bind((sources[i % len(sources)], 0))
            s.settimeout(2)
            s.connect((host, int(port)))
            s.sendall(head)
            held.append(s)
        except OSError:
            s.close()
    return held


def exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh loopback connection to ``port``; everything the server sends until it
    closes the connection, with ``b"<open>"`` appended when it is still open after ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            return out + b"<open>"
    return out


def still_open(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the server has not closed (a closed one reads EOF or a reset)."""
    n = 0
    for s in sockets:
        s.setblocking(False)
        try:
            n += s.recv(1) != b""
        except BlockingIOError:
            n += 1
        except OSError:
            pass
    return n


def close_all(sockets: list[Any]) -> None:
    for s in sockets:
        with contextlib.suppress(Exception):
            s.close()


@dataclass
class Streams:
    """Idle anonymous gRPC streams held open (``idle_streams``) and the refusals they met."""

    channels: list[grpc.Channel]
    calls: list[Any]
    held: int
    refused: dict[str, int]
    retry_hints: int

    def close(self) -> None:
        for call in self.calls:
            with contextlib.suppress(Exception):
                call.cancel()
        for ch in self.channels:
            ch.close()


def _blocking_requests(first: Any) -> Iterator[Any]:
    yield first
    while True:  # a client that never sends its next request (nor closes its side)
        time.sleep(3600)


def idle_streams(target: str, count: int, per_channel: int, kind: str = "watch") -> Streams:
    """``count`` anonymous streams (``watch``: Health.Watch; ``reflection``: ServerReflectionInfo) on
    connections of ``per_channel`` streams each, each read up to its first answer and then left idle."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channels: list[grpc.Channel] = []
    calls: list[Any] = []
    refused: dict[str, int] = {}
    hints = held = 0
    for i in range(count):
        if i % per_channel == 0:
            channels.append(channel(target))
        ch = channels[-1]
        if kind == "watch":
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
        else:
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(_blocking_requests(ask))
        calls.append(call)
        try:
            next(call)
            held += 1
        except grpc.RpcError as exc:
            refused[exc.code().name] = refused.get(exc.code().name, 0) + 1
            hints += any(k == "grpc-status-details-bin" for k, _ in (exc.trailing_metadata() or ()))
    return Streams(channels, calls, held, refused, hints)


class HalfOpenCalls:
    """``count`` gRPC calls on each of ``connections`` HTTP/2 connections, to ``methods`` in turn, each
    call sending its headers (with ``key`` as its bearer credentials, if any) and never its request
    message: the calls a client holds open to take the server's capacity. They run on an event loop of their own (one thread
    for all: grpc.aio wants one loop per process); ``outcome()`` tallies how the calls have ended so far
    (``held``: not yet ended), the longest each status took, and the first message of each."""

    def __init__(self, target: str, methods: str | Sequence[str], count: int, key: str | None = None,
                 connections: int = 1) -> None:
        import asyncio

        self.methods = [methods] if isinstance(methods, str) else list(methods)
        self.num_calls = count * connections
        self.ended: dict[str, list[float]] = {}
        self.details: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: Any = None
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._main(target, key, count, connections),), daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError(f"could not open {connections} gRPC connections to {target}")

    async def _main(self, target: str, key: str | None, count: int, connections: int) -> None:
        import asyncio

        self._stop = asyncio.Event()
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(connections)]

        async def never() -> Any:
            await self._stop.wait()
            if False:  # an async generator that yields nothing while the calls are held
                yield b""

        async def one(ch: Any, method: str) -> None:
            start = time.perf_counter()
            try:
                await ch.stream_unary(method, request_serializer=None, response_deserializer=None)(
                    never(), metadata=metadata)
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                self.details.setdefault(code, str(exc.details())[:200])
            except asyncio.CancelledError:
                return
            self.ended.setdefault(code, []).append(time.perf_counter() - start)

        try:
            for ch in channels:
                await ch.channel_ready()
            tasks = [asyncio.ensure_future(one(ch, self.methods[i % len(self.methods)]))
                     for ch in channels for i in range(count)]
            self._ready.set()
            await self._stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for ch in channels:
                await ch.close()

    def outcome(self) -> dict[str, Any]:
        ended = {code: len(times) for code, times in self.ended.items()}
        return {"calls": self.num_calls, "held": self.num_calls - sum(ended.values()), "ended": ended,
                "ended_after_s": {code: round(max(times), 2) for code, times in self.ended.items()},
                "messages": dict(self.details)}

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ONE_CALL_TRACE_LINE = (b'{"tenant": "t", "session": "s", "messages": [{"role": "user", "content": "q"}, '
                       b'{"role": "assistant", "content": "a"}]}\n')


def trace_bomb(path: Path, line_bytes: int = 1536 * MiB) -> Path:
    """A gzip trace file whose second line is ``line_bytes`` long (a JSON string that goes on and on):
    gzip members of one compressed 16 MiB chunk, repeated, so a 1.5 GB line takes a few MB and a second
    to write."""
    import gzip

    good = ONE_CALL_TRACE_LINE
    chunk = gzip.compress(b"A" * (16 * MiB), compresslevel=9)
    with open(path, "wb") as fh:
        fh.write(gzip.compress(good + b'{"tenant": "'))
        fh.writelines(chunk for _ in range(line_bytes // (16 * MiB)))
        fh.write(gzip.compress(b'"}\n' + good))
    return path


@dataclass(frozen=True)
class CliRun:
    """A `reprise` command run in a fresh process: its exit code, stderr, seconds, and its peak RSS
    above its RSS when the command began (after Python and the CLI were loaded)."""

    returncode: int
    stderr: str
    seconds: float
    peak_above_start: int


_MEASURED_CLI = """
import sys
from pathlib import Path
from reprise.cli import main

def status(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

Path("/proc/self/clear_refs").write_text("5")  # VmHWM from now (ru_maxrss would carry the parent's over exec)
start = status("VmRSS")
code = main(sys.argv[1:])
print("peak_above_start", status("VmHWM") - start, file=sys.stderr)
sys.exit(code)
"""


def run_cli(*argv: str, timeout_s: float = 600.0) -> CliRun:
    """``reprise ARGV...`` in a fresh Python process, measured (``CliRun``)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _MEASURED_CLI, *argv], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    seconds = time.perf_counter() - start
    head, _, peak = done.stderr.rpartition("peak_above_start ")
    return CliRun(done.returncode, head if peak else done.stderr, seconds, int(peak) if peak.strip() else -1)


def huge_chat(num_messages: int = 30_000, total_bytes: int = 15_000_000) -> dict[str, Any]:
    """A chat body of ``num_messages`` messages and about ``total_bytes`` bytes."""
    each = max(1, total_bytes // num_messages - 40)
    content = ("lorem ipsum " * (each // 12 + 1))[:each]
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": content}
                         for i in range(num_messages)], "max_tokens": 4}
