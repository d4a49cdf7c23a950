"""One tenant floods a real `reprise serve`, another asks meanwhile: the fair-share figures of `reprise bench
attack` (``slots_flood``, ``prefix_flood``) and what tests/hostile/test_share_floods.py asserts.

    with Flood(served, key_a, num_requests=16, max_tokens=1500):   # A keeps 16 maximal completions going
        seconds = chat_latencies(served, key_b, 20)                 # B's 8-token chats, one after another
    cached = prefix_survival(served, key_a, key_b, num_tokens=1884, num_prompts=14)

Everything goes through the OpenAI-compatible HTTP API, as the issue's tenants sent it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from reprise.benchmarks.hostile import Served, grpc_health, healthz, http_call

if TYPE_CHECKING:
    from typing_extensions import Self

CHAT = [{"role": "user", "content": "hello"}]
WORDS = ("agent", "tool", "plan", "file", "call", "result", "step", "note", "task", "check", "value", "trace")


class Flood:
    """Tenant ``key``'s ``num_requests`` concurrent ``/v1/completions`` of ``max_tokens`` each with
    ``ignore_eos`` (greedy, the server's default, unless a ``temperature`` is given), each sent again as
    soon as it ends, until the block ends; then their connections are shut (the server stops decoding
    them at its next step). ``answers``: the HTTP statuses it got."""

    def __init__(self, served: Served, key: str, *, num_requests: int = 16, max_tokens: int = 1500,
                 temperature: float | None = None) -> None:
        self.served = served
        self.key = key
        body: dict[str, Any] = {"prompt": "Tell a long story about a journey.", "max_tokens": max_tokens,
                                "ignore_eos": True}
        if temperature is not None:
            body["temperature"] = temperature
        self.body = json.dumps(body).encode()
        self.answers: list[int] = []
        self._stop = threading.Event()
        self._conns: list[http.client.HTTPConnection | None] = [None] * num_requests
        self._threads = [threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(num_requests)]

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for conn in self._conns:
            if conn is not None and conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on its answer
        for t in self._threads:
            t.join(30)

    def wait_running(self, num_requests: int, timeout_s: float = 120.0) -> bool:
        """Wait until the server holds at least ``num_requests`` requests in flight (this flood's)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.served.metric("reprise_num_requests_running") >= num_requests:
                return True
            time.sleep(0.2)
        return False

    def _send(self, i: int) -> None:
        host, port = self.served.http.removeprefix("http://").rsplit(":", 1)
        while not self._stop.is_set():
            conn = http.client.HTTPConnection(host, int(port), timeout=3600)
            self._conns[i] = conn
            try:
                conn.request("POST", "/v1/completions", body=self.body, headers={
                    "Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                self.answers.append(response.status)
                if response.status != 200:
                    self._stop.wait(0.5)  # over its limit: a flooding client retries
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()


def chat_latencies(served: Served, key: str, num_requests: int, max_tokens: int = 8) -> list[float]:
    """Seconds of ``num_requests`` 8-token chats of tenant ``key``, one after another; RuntimeError
    naming the answer if one is not a 200."""
    seconds = []
    for _ in range(num_requests):
        start = time.perf_counter()
        status, _, doc = http_call(served.http, "POST", "/v1/chat/completions",
                                   {"messages": CHAT, "max_tokens": max_tokens}, key=key, timeout=600)
        if status != 200:
            raise RuntimeError(f"a chat of the waiting tenant was answered {status}: {doc}")
        seconds.append(time.perf_counter() - start)
    return seconds


def health_now(served: Served) -> tuple[str, str]:
    """What /healthz and gRPC health say now."""
    return healthz(served.http, 30)[0], grpc_health(served.grpc_target, 30)[0]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (p95 of 20 values: the 19th smallest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def long_prompt(seed: int, num_words: int) -> str:
    """A prompt of ``num_words`` words that no other seed's shares a prefix with."""
    return f"[{seed}] " + " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(num_words))


def cached_tokens(served: Served, key: str, prompt: str) -> int:
    """The prompt tokens the server found cached for ``prompt`` (one token asked)."""
    status, _, doc = http_call(served.http, "POST", "/v1/completions",
                               {"prompt": prompt, "max_tokens": 1, "temperature": 0}, key=key, timeout=600)
    if status != 200:
        raise RuntimeError(f"a completion was answered {status}: {doc}")
    return int(doc["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def prefix_survival(served: Served, attacker: str, victim: str, *, num_words: int,
                    num_prompts: int) -> dict[str, Any]:
    """The victim's repeated prompt is cached; the attacker then sends ``num_prompts`` distinct prompts
    of the same length; what the victim's next repeat finds cached, what each took, and the blocks the
    own engine's prefix cache evicted meanwhile (None on vLLM, which does not say)."""
    prompt = long_prompt(0, num_words)
    cached_tokens(served, victim, prompt)
    start = time.perf_counter()
    before = cached_tokens(served, victim, prompt)
    before_s = time.perf_counter() - start
    evicted = evicted_blocks(served)
    for i in range(num_prompts):
        cached_tokens(served, attacker, long_prompt(1 + i, num_words))
    start = time.perf_counter()
    after = cached_tokens(served, victim, prompt)
    after_s = time.perf_counter() - start
    now = evicted_blocks(served)
    return {"attacker_prompts": num_prompts, "cached_before": before, "seconds_before": round(before_s, 3),
            "cached_after": after, "seconds_after": round(after_s, 3),
            "evicted_blocks": None if now is None or evicted is None else now - evicted}


def evicted_blocks(served: Served) -> int | None:
    """The own engine's ``reprise_prefix_cache_evicted_blocks_total``; None where the server has none."""
    name = "reprise_prefix_cache_evicted_blocks_total"
    status, _, text = http_call(served.http, "GET", "/metrics", key=served.admin_key)
    if status != 200 or name not in str(text):
        return None
    return int(served.metric(name))
