"""Test doubles for the gRPC layer's unit tests only (the shipped service wires the real pipeline and
store: tests/service/ runs those end to end)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpc_api import errors
from grpc_api.backend import (
    CorpusDocument,
    CorpusImport,
    GenerateParams,
    Generation,
    HistoryImport,
    KeyRotation,
    ModelInfo,
    Principal,
    Progress,
    PromptInput,
    TenantInfo,
    TenantStats,
)
from grpc_api.server import GrpcServer

VOCAB = 64
EOS = 0


def fake_next_token(context: Sequence[int]) -> int:
    """A deterministic 'model': the next token is a function of the last two."""
    a = context[-1] if context else 1
    b = context[-2] if len(context) > 1 else 3
    return 1 + (a * 7 + b * 3) % (VOCAB - 1)  # never EOS unless forced


def fake_text(token: int) -> str:
    return chr(ord("a") + token % 26)


@dataclass
class FakeDecode:
    step_seconds: float = 0.0
    tokens_per_step: int = 3
    max_context: int = 512
    eos_after: int | None = None  # emit EOS after this many tokens
    active: int = 0
    max_active: int = 0
    calls: list = field(default_factory=list)
    history: dict = field(default_factory=dict)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    fail_with: BaseException | None = None

    def model_info(self) -> ModelInfo:
        return ModelInfo("fake", self.max_context, (EOS,), VOCAB, True)

    def tokenize(self, prompt: PromptInput, add_generation_prompt: bool = True) -> list[int]:
        if prompt.text is not None:
            return [1 + ord(c) % (VOCAB - 1) for c in prompt.text]
        text = "".join(f"<{m.role}>{m.content}" for m in prompt.messages or ())
        return [1 + ord(c) % (VOCAB - 1) for c in text] + ([2] if add_generation_prompt else [])

    def expected(self, prompt_ids: Sequence[int], max_new: int) -> list[int]:
        ctx = list(prompt_ids)
        out: list[int] = []
        while len(out) < max_new:
            if self.eos_after is not None and len(out) == self.eos_after:
                out.append(EOS)
                break
            t = fake_next_token(ctx)
            ctx.append(t)
            out.append(t)
        return out

    def generate(self, tenant: str, session_id: str, request_id: str, prompt_ids: Sequence[int],
                 params: GenerateParams, on_tokens, cancel: threading.Event) -> Generation:
        if self.fail_with is not None:
            raise self.fail_with
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.calls.append((tenant, session_id, request_id, list(prompt_ids), params))
        try:
            full = self.expected(prompt_ids, params.max_new_tokens)
            out: list[int] = []
            while len(out) < len(full):
                if cancel.is_set():
                    return Generation("aborted", None, len(prompt_ids), len(out))
                if self.step_seconds:
                    time.sleep(self.step_seconds)
                step = full[len(out): len(out) + self.tokens_per_step]
                for i, t in enumerate(step):
                    if t in params.stop_token_ids and len(out) + i + 1 > params.min_new_tokens:
                        step = step[: i + 1]
                        out += step
                        on_tokens(step, "".join(fake_text(x) for x in step))
                        return Generation("stop", t, len(prompt_ids), len(out))
                out += step
                on_tokens(step, "".join(fake_text(x) for x in step))
            reason = "eos" if out and out[-1] == EOS and not params.ignore_eos else "length"
            if params.record:
                self.history.setdefault(tenant, []).append(list(prompt_ids) + out)
            return Generation(reason, None, len(prompt_ids), len(out))
        finally:
            with self.lock:
                self.active -= 1

    def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        self.history.setdefault(tenant, []).append(list(token_ids))
        return len(token_ids)

    def close(self) -> None:
        self.closed = True


class FakeAdmin:
    def __init__(self, auth: FakeAuth) -> None:
        self.auth = auth
        self.tenants: dict[str, TenantInfo] = {}
        self.corpus: dict[str, list[CorpusDocument]] = {}
        self.deleted: list[str] = []

    def _known(self, tenant_id: str) -> None:
        if tenant_id not in self.tenants:
            raise errors.NotFound(f"no tenant {tenant_id}")

    def create_tenant(self, name: str) -> tuple[TenantInfo, str]:
        if not name:
            raise ValueError("tenant name is empty")
        tid = f"t{len(self.tenants):031d}"
        info = TenantInfo(tid, name, 1000)
        self.tenants[tid] = info
        key = f"rpk_{tid}"
        self.auth.keys[key] = Principal("tenant", tid)
        return info, key

    def list_tenants(self) -> list[TenantInfo]:
        return list(self.tenants.values())

    def delete_tenant(self, tenant_id: str, dry_run: bool = False) -> int:
        self._known(tenant_id)
        if not dry_run:
            del self.tenants[tenant_id]
            self.deleted.append(tenant_id)
        return 7

    def rotate_keys(self, kind: str, tenant_id: str, progress) -> KeyRotation:
        if kind == "master_key":
            for i in range(3):
                progress(Progress("rewrap", i + 1, 3, "keys"))
            return KeyRotation(key_version=2, num_records=3)
        self._known(tenant_id)
        if kind == "api_key":
            for k, p in list(self.auth.keys.items()):
                if p.id == tenant_id:
                    del self.auth.keys[k]
            key = f"rpk2_{tenant_id}"
            self.auth.keys[key] = Principal("tenant", tenant_id)
            return KeyRotation(api_key=key)
        progress(Progress("reencrypt", 1, 1, "records"))
        return KeyRotation(key_version=2, num_records=1)

    def index_stats(self, tenant_id: str | None) -> list[TenantStats]:
        ids = [tenant_id] if tenant_id else list(self.tenants)
        for t in ids:
            self._known(t)
        return [TenantStats(t, index_tokens=100, num_steps=10, num_drafted_steps=5, num_accepted_tokens=8,
                            num_draft_tokens=20, acceptance_by_position=(0.8, 0.5), drafter_steps={"suffix": 5})
                for t in ids]

    def build_index(self, tenant_id: str, progress) -> TenantStats:
        self._known(tenant_id)
        for i in range(4):
            progress(Progress("index", i + 1, 4, "records"))
        return self.index_stats(tenant_id)[0]

    compact_index = build_index

    def import_corpus(self, tenant_id: str, documents: Iterable[CorpusDocument], replace: bool,
                      progress) -> CorpusImport:
        self._known(tenant_id)
        docs = list(documents)  # consumes the upload; raises if it broke off
        if replace:
            self.corpus[tenant_id] = []
        self.corpus.setdefault(tenant_id, []).extend(docs)
        tokens = sum(len(d.token_ids or ()) + len(d.text or "") for d in docs)
        return CorpusImport(len(docs), tokens, tokens)

    def export_history(self, tenant_id: str, password: str, write, progress) -> int:
        self._known(tenant_id)
        write(password.encode() + b":")
        for i in range(3):
            progress(Progress("export", i + 1, 3, "chunks"))
            write(bytes([i]) * 1000)
        return 3000 + len(password) + 1

    def import_history(self, source, password: str, new_tenant_name: str, into_tenant_id: str,
                       progress) -> HistoryImport:
        data = source.read()
        if not data.startswith(password.encode() + b":"):
            raise errors.DataLoss("export file failed authentication (wrong password or altered file)")
        if into_tenant_id:
            self._known(into_tenant_id)
            return HistoryImport(self.tenants[into_tenant_id], False, len(data), 0)
        info, key = self.create_tenant(new_tenant_name or "imported")
        return HistoryImport(info, True, len(data), 0, key)


class FakeAuth:
    def __init__(self) -> None:
        self.keys: dict[str, Principal] = {"rpa_admin": Principal("admin", "admin-key-1")}

    def authenticate(self, key: str) -> Principal | None:
        return self.keys.get(key)


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    grpc_port: int = 0
    max_message_bytes: int = 1 << 20
    max_concurrent_requests: int = 8
    max_requests_per_tenant: int = 4
    default_max_new_tokens: int = 16
    stream_chunk_tokens: int = 1
    grace_seconds: float = 2.0
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    num_worker_threads: int = 12
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""


class ServerThread:
    """A GrpcServer on its own event loop in a background thread (sync tests talk to it over loopback)."""

    def __init__(self, decode: Any, admin: Any, auth: Any, settings: Any, metrics: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(self._make(decode, admin, auth, settings, metrics))
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"

    @staticmethod
    async def _make(*args: Any) -> GrpcServer:
        return GrpcServer(*args, version="test")

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()

        return self.call(run())

    def stop(self, grace: float | None = None) -> None:
        self.call(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
