"""Test doubles for the gRPC layer's unit tests only (the shipped service wires the real pipeline and
store: tests/service/ runs those end to end)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpc_api.server import GrpcServer
from serving import errors
from serving.admin import (
    BadRecordInfo,
    CorpusDocument,
    CorpusImport,
    HistoryCheck,
    HistoryExport,
    HistoryImport,
    IndexMemory,
    KeyRotation,
    Progress,
    TenantInfo,
    TenantStats,
)
from serving.core import ServingCore
from serving.prepare import ServingSettings
from serving.records import BackendEvent, Finished, ModelInfo, Principal, PromptInput, Request, Tokens, Usage
from serving.render import PromptRenderer, model_info
from serving.savings import Savings

VOCAB = 64
EOS = 0


def fake_next_token(context: Sequence[int]) -> int:
    """A deterministic 'model': the next token is a function of the last two."""
    a = context[-1] if context else 1
    b = context[-2] if len(context) > 1 else 3
    return 1 + (a * 7 + b * 3) % (VOCAB - 1)  # never EOS unless forced


def fake_text(token: int) -> str:
    return chr(ord("a") + token % 26)


class FakeTokenizer:
    """One token per character (``1 + ord(c) % 63``); chat renders ``<role>content`` and a generation
    prompt token 2; a token decodes to one letter (``fake_text``)."""

    chat_template = "<{{ role }}>{{ content }}"

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + ord(c) % (VOCAB - 1) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(fake_text(int(t)) for t in ids)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [fake_text(int(t)) for t in ids]

    def apply_chat_template(self, messages: list[dict], tools: Any = None, add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text) + ([2] if add_generation_prompt else [])


@dataclass
class FakeDecode:
    """A ``serving.backend.DecodeBackend`` whose 'model' is ``fake_next_token``, ``tokens_per_step``
    tokens a step, ``step_seconds`` apart."""

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
    tokenizer: Any = field(default_factory=FakeTokenizer)
    alive: bool = True

    def model_info(self) -> ModelInfo:
        return model_info(self.tokenizer, "fake", self.max_context, (EOS,), VOCAB)

    def tokenize(self, prompt: PromptInput, add_generation_prompt: bool = True) -> list[int]:
        """What the serving core renders ``prompt`` to for this backend."""
        return PromptRenderer(self.tokenizer, self.model_info()).render(prompt, add_generation_prompt)

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

    async def check(self, request: Request) -> None:
        pass

    async def generate(self, request: Request, cancel: threading.Event) -> AsyncIterator[BackendEvent]:
        if self.fail_with is not None:
            raise self.fail_with
        params, prompt_ids = request.params, request.prompt_ids
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.calls.append((request.tenant, request.session_id, request.request_id, list(prompt_ids), params))

        def end(reason: str, out: list[int], matched: int | None = None) -> Finished:
            return Finished(reason, Usage(len(prompt_ids), len(out)), matched, token_ids=tuple(out))  # type: ignore[arg-type]

        try:
            full = self.expected(prompt_ids, params.max_new_tokens)
            out: list[int] = []
            while len(out) < len(full):
                if cancel.is_set():
                    yield end("aborted", out)
                    return
                if self.step_seconds:
                    await asyncio.sleep(self.step_seconds)
                step = full[len(out): len(out) + self.tokens_per_step]
                for i, t in enumerate(step):
                    if t in params.stop_token_ids and len(out) + i + 1 > params.min_new_tokens:
                        step = step[: i + 1]
                        out += step
                        yield Tokens(tuple(step), "".join(fake_text(x) for x in step))
                        yield end("stop", out, t)
                        return
                out += step
                yield Tokens(tuple(step), "".join(fake_text(x) for x in step))
            reason = "eos" if out and out[-1] == EOS and not params.ignore_eos else "length"
            if params.record:
                self.history.setdefault(request.tenant, []).append(list(prompt_ids) + out)
            yield end(reason, out)
        finally:
            with self.lock:
                self.active -= 1

    async def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        self.history.setdefault(tenant, []).append(list(token_ids))
        return len(token_ids)

    async def close(self) -> None:
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
                            num_draft_tokens=20, acceptance_by_position=(0.8, 0.5), drafter_steps={"suffix": 5},
                            savings=Savings(0.5, 0.9, 0.25, 0.35, 18))
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

    def index_memory(self) -> IndexMemory:
        return IndexMemory(budget_bytes=1 << 30, resident_bytes=1000, resident_tenants=len(self.tenants))

    def verify_history(self, tenant_id: str, progress) -> HistoryCheck:
        self._known(tenant_id)
        progress(Progress("verify", 3, 3, "trajectories"))
        return HistoryCheck(tenant_id, 3, (BadRecordInfo("trajectory", "ab" * 16, "2", "authentication failed"),),
                            False, 0)

    def repair_history(self, tenant_id: str, progress) -> HistoryCheck:
        check = self.verify_history(tenant_id, progress)
        return HistoryCheck(tenant_id, check.num_records, check.bad, True, 1)

    def export_history(self, tenant_id: str, password: str, write, progress) -> HistoryExport:
        self._known(tenant_id)
        write(password.encode() + b":")
        for i in range(3):
            progress(Progress("export", i + 1, 3, "chunks"))
            write(bytes([i]) * 1000)
        return HistoryExport(3000 + len(password) + 1, 3)

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
    public_streams_total: int = 64
    public_streams_per_connection: int = 4
    admin_max_calls: int = 64
    grpc_message_timeout_s: float = 10.0
    grpc_pending_per_connection: int = 32
    grpc_pending_per_address: int = 128
    grpc_pending_total: int = 1024
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
    async def _make(decode: Any, admin: Any, auth: Any, settings: Any, metrics: Any) -> GrpcServer:
        core = ServingCore(decode, ServingSettings(settings.default_max_new_tokens, settings.stream_chunk_tokens,
                                                   settings.max_concurrent_requests,
                                                   settings.max_requests_per_tenant), metrics)
        return GrpcServer(core, admin, auth, settings, metrics, version="test")

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()

        return self.call(run())

    async def shutdown(self, grace: float | None = None) -> None:
        """What the service does on stop: the server drains, then the core closes (the backend with it)."""
        await self.server.stop(grace)
        await self.server.core.close()

    def stop(self, grace: float | None = None) -> None:
        self.call(self.shutdown(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
