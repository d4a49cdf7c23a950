"""Helpers of the service tests: an event loop in a thread that runs a server while sync code talks to
it, and a real service (encrypted SQLite store in a temp dir, the decode pipeline, gRPC, HTTP) around a
tiny random Llama with a real byte-level tokenizer, on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprise.config import load_config
from reprise.engine.request import GenerationResult
from reprise.offline.tiny import TINY_EOS, byte_level_tokenizer, tiny_llama  # noqa: F401 - re-exported
from reprise.service import Service
from serving.records import Request, Usage
from verifier.models import LoadedModel


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()

        return self.call(run())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


byte_tokenizer = byte_level_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    service: Any
    loop: LoopThread
    target: str
    http: str
    admin_key: str
    home: Path

    def metrics(self) -> str:
        """The Prometheus text of /metrics, read with the admin key (no key: 401)."""
        request = urllib.request.Request(self.http + "/metrics", headers={"Authorization": f"Bearer {self.admin_key}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.read().decode()

    def stop(self, grace: float | None = 0) -> None:
        self.loop.call(self.service.stop(grace))
        self.loop.close()


def start_service(home: Path, model: Any = None, tokenizer: Any = None, **settings: Any) -> Running:
    flags = {"home": str(home), "server.grpc_port": "0", "server.http_port": str(free_port()),
             "model.num_slots": "4", "model.max_len": "1000", "server.stats_interval_s": "0.2", **settings}
    config = load_config(flags, env={})
    loaded = LoadedModel(model if model is not None else tiny_llama(), tokenizer or byte_tokenizer(), "tiny-llama")
    loop = LoopThread()

    async def make() -> Any:
        return Service(config, model=loaded, model_name="tiny-llama")

    service = loop.call(make())
    loop.call(service.start(), timeout=120)
    admin_key = (home / "admin.key").read_text().strip()
    return Running(service, loop, f"127.0.0.1:{service.grpc_port}", f"http://127.0.0.1:{service.http_port}",
                   admin_key, home)


def finished_turn(tenant: str, session_id: str, request_id: str, prompt_ids, output_ids) -> GenerationResult:
    """A finished, recorded turn as the engine hands it to a history sink."""
    request = Request.of_tokens(prompt_ids, tenant=tenant, session_id=session_id, request_id=request_id)
    output = tuple(int(t) for t in output_ids)
    return GenerationResult(request, output, "", "length", None, Usage(len(request.prompt_ids), len(output), steps=1))
