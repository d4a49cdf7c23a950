"""The whole service, assembled in one typed place from one ``ServiceConfig``: what `reprise serve` runs.

    service = Service(config)            # tests: Service(config, model=LoadedModel(...)) or vllm_engine=...
    await service.start()                # store, model, engine, serving core, gRPC, HTTP, stats sampler
    await service.wait()                 # until SIGTERM/SIGINT (install_signal_handlers) or stop()
    sys.exit(service.exit_code)          # not 0 when the engine died: an orchestrator replaces the process

This module sits above the parts it wires (``reprise.server``, ``reprise.cluster``, ``reprise.backends``,
the fronts ``grpc_api`` and ``http_api``, the core ``serving``), so none of them imports another sideways
to be wired. Start-up order: the model (first: the slow part and the usual failure, before any key is
written), the encrypted store (and, on first start, the admin key file), the engine and its backend,
the tenants' indexes, the serving core, the gRPC server (data and admin planes) and the HTTP server
(the OpenAI-compatible API under /v1, /healthz, /metrics, /dashboard). Shutdown (``stop``) reverses it:
health NOT_SERVING, in-flight streams finish within the grace period, the engine stops, queued history
is written, the store closes.

If the engine dies (its thread ends with an error), health turns NOT_SERVING at once on both fronts,
every request it held fails with UNAVAILABLE, and the service stops with ``exit_code`` 70 (EX_SOFTWARE).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpc_api.interceptors import ADMIN_PLANE
from grpc_api.server import SERVICE_NAMES, GrpcServer
from http_api.app import build_app
from http_api.server import HttpLimits, HttpServer
from privacy import HistoryStore, ensure_admin_key, open_store
from reprise import __version__
from reprise.backends.engine import EngineBackend
from reprise.backends.vllm.backend import VllmBackend
from reprise.backends.vllm.engine import VllmEngine
from reprise.cluster.indexes import ReplicatedIndexes
from reprise.cluster.node import ClusterNode
from reprise.cluster.writer import ReplicaWriter
from reprise.config import ServiceConfig
from reprise.drafters import DEFAULT_DRAFTER, make_proposer
from reprise.engine.engine import Engine, EngineConfig
from reprise.server.admin import ServiceAdmin
from reprise.server.auth import StoreAuthenticator
from reprise.server.dashboard import StatsHistory, dashboard_router
from reprise.server.hidden_store import ReuseWiring
from reprise.server.history_writer import HistoryWriter
from reprise.server.index_budget import IndexResidency
from reprise.server.indexes import TenantIndexes
from reprise.server.metering import StepMeter, TenantAccounting
from reprise.server.metrics import ServiceMetrics
from reprise.server.responses import StoredResponses
from reprise.server.tenant_config import apply_tenant_configs
from reprise.server.vllm import attach_tenants, start_vllm_engine, vllm_backend
from serving.backend import TenantResidency
from serving.core import ServingCore
from serving.holdout import Holdout
from serving.prepare import ServingSettings
from serving.records import Authenticator
from verifier.models import LoadedModel, configure_threads, load_default_model, load_model, served_model_name
from verifier.runner import ModelRunner

log = logging.getLogger(__name__)
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine died; restart the process

Backend = EngineBackend | VllmBackend
Indexes = TenantIndexes | ReplicatedIndexes


def load_target_model(config: ServiceConfig) -> LoadedModel:
    """The configured model: a local folder or the default SmolLM2."""
    m = config.model
    if m.path:
        return load_model(m.path, dtype=m.dtype, device=m.device, num_threads=m.num_threads)
    return load_default_model(num_threads=m.num_threads, device=m.device, dtype=m.dtype)


def make_private_dir(path: Path) -> None:
    """The data directory, created 0700 (it holds the master key, the admin key and the encrypted store)
    with any missing parents; an existing directory keeps the mode its operator gave it."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)  # mkdir's mode passes through the umask


def check_port_free(host: str, port: int) -> None:
    """OSError naming the address if something listens there (a quick probe; the real bind decides)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


@dataclass
class Decoding:
    """What decodes: the backend the core talks to, the tenants' indexes and what keeps a request's
    tenant in memory while it decodes, the history writer and, on the own engine, the engine itself and
    its hidden-state reuse."""

    backend: Backend
    indexes: Indexes
    residency: TenantResidency
    history: HistoryWriter | ReplicaWriter
    engine: Engine | None = None
    reuse: ReuseWiring | None = None


class Service:
    """Store + engine + serving core + gRPC + HTTP, started and stopped together (module docstring)."""

    def __init__(self, config: ServiceConfig, *, model: LoadedModel | None = None, model_name: str = "",
                 vllm_engine: VllmEngine | None = None) -> None:
        self.config = config
        self._model = model
        self._vllm_engine = vllm_engine  # with model.engine "vllm": an engine already started (tests)
        self._model_name = model_name
        self.store: HistoryStore | None = None
        self.metrics = ServiceMetrics()
        self.cluster: ClusterNode | None = None
        self.decoding: Decoding | None = None
        self.core: ServingCore | None = None
        self.grpc: GrpcServer | None = None
        self.http: HttpServer | None = None
        self.stats_history: StatsHistory | None = None
        self.admin_key_file: Path | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.exit_code = 0
        self.holdout = Holdout(config.server.holdout_share)  # what drafting saves, measured on a share of requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app: object = None

    # ---- start-up ------------------------------------------------------------------------------------

    async def start(self) -> None:
        check_port_free(self.config.server.host, self.config.server.grpc_port)  # before the slow part
        loop = self._loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._build)
        assert self.grpc is not None and self.stats_history is not None
        self.grpc_port = await self.grpc.start()
        self.http_port = await self.http.start(self._app) if self.http is not None else 0
        self.stats_history.start()
        if self.cluster is not None:
            assert self.core is not None
            admission = self.core.admission  # runs on the event loop: deletions elsewhere cancel from here

            def cancel_tenant(tenant: str) -> None:
                loop.call_soon_threadsafe(admission.cancel_tenant, tenant)

            self.cluster.replica.on_tenant_gone(cancel_tenant)
            self.cluster.start()

    def _build(self) -> None:
        c = self.config
        make_private_dir(c.home)
        if c.server.http_port:
            check_port_free(c.server.host, c.server.http_port)
        # The model first: a start that cannot load it (the slow part, and the usual failure) has written
        # no master key or admin key file yet.
        loaded = None
        if c.model.engine != "vllm":  # vLLM loads the model itself, in its own processes
            loaded = self._model if self._model is not None else load_target_model(c)
        store = self.store = open_store(c.store)
        try:
            if c.cluster.enabled:  # replicas on one Redis (reprise.cluster, docs/cluster.md)
                self.cluster = ClusterNode(c.cluster, store, None, self.metrics)
            auth: Authenticator = self.cluster.authenticator() if self.cluster else StoreAuthenticator(store)
            if c.server.http_port:  # bind now: the HTTP port is free before the store writes anything
                self.http = HttpServer(c.server.host, c.server.http_port, c.server.settings_for(HttpLimits, "http_"))
            self.admin_key_file = ensure_admin_key(store)
            if self.admin_key_file is not None:
                log.warning("first start: the admin key is in %s (0600); `reprise tenant ...` reads it there",
                            self.admin_key_file)
            invalidate: Callable[[], None] = getattr(auth, "invalidate", lambda: None)
            if c.model.engine == "vllm":  # vLLM decodes, Reprise drafts in its worker (docs/vllm.md)
                self.decoding = self._vllm(store, invalidate)
            else:
                assert loaded is not None
                self.decoding = self._own_engine(store, loaded, invalidate)
            self.core = ServingCore(self.decoding.backend, c.server.settings_for(ServingSettings), self.metrics,
                                    render_threads=c.server.num_worker_threads, residency=self.decoding.residency,
                                    holdout=self.holdout)
            admin = ServiceAdmin(store, self.decoding.indexes, invalidate)
            self.grpc = GrpcServer(self.core, admin, auth, c.server, self.metrics, version=__version__,
                                   health=self.health)
            self.stats_history = StatsHistory(lambda: admin.index_stats(None), admin.list_tenants,
                                              interval_s=c.server.stats_interval_s)
            retention_s = c.server.response_retention_days * 86400
            self._app = build_app(self.core, auth, self.metrics.render, self.health,
                                  max_body_bytes=c.server.max_message_bytes,
                                  routers=[dashboard_router(auth, self.stats_history.snapshot)],
                                  responses=StoredResponses(store, retention_s) if retention_s else None,
                                  observe=self.metrics.observe_http)
        except BaseException:
            if self.decoding is not None:
                self.decoding.backend.close_now()  # stops the engine thread, writes queued history
            if self.cluster is not None:
                self.cluster.stop()
            if self.http is not None:
                self.http.close()
                self.http = None
            store.close()
            self.store = None
            raise

    def _own_engine(self, store: HistoryStore, loaded: LoadedModel, invalidate: Callable[[], None]) -> Decoding:
        """Reprise's own engine on a thread, its proposer, the tenants' indexes, the history writer."""
        c = self.config
        if c.model.device == "cpu":  # also for a model handed in: two replicas' thread pools would fight
            configure_threads(c.model.num_threads)
        tokenizer = loaded.tokenizer
        name = self._model_name or served_model_name(loaded.source or "model")
        runner = ModelRunner(loaded.model, num_slots=c.model.num_slots, max_len=c.model.max_len,
                             max_draft_nodes=c.model.max_draft_nodes, prefix_cache_bytes=c.model.prefix_cache_bytes)
        accounting = TenantAccounting(runner.prefix_cache, self.holdout)
        inner = make_proposer(c.model.drafter or DEFAULT_DRAFTER, c.drafting)
        if tokenizer is not None and hasattr(inner, "set_vocabulary"):  # numbers match by class
            inner.set_vocabulary(lambda i: tokenizer.decode([i]), runner.vocab_size)
        tuned = apply_tenant_configs(inner, store.list_tenants(), c.home)  # `reprise tune`'s
        if tuned:
            log.info("%d tenants draft with their own tuned settings", tuned)
        tokenize = (lambda text: list(tokenizer.encode(text, add_special_tokens=False))) if tokenizer else None
        indexes, residency = self._indexes(store, inner, accounting, tokenize)
        found = ReuseWiring.find(inner)
        reuse = ReuseWiring(found, store) if found is not None else None
        if reuse is not None:  # hidden-state reuse vectors are tenant history: sealed, restored
            log.info("restored %d hidden-state segments", reuse.restore_all(store.list_tenants()))
        history = self.cluster.writer if self.cluster is not None else HistoryWriter(store)
        engine = Engine(runner, inner, tokenizer,
                        EngineConfig(history_sink=history.put, observer=StepMeter(accounting, self.metrics),
                                     index_turns=self.cluster is None))

        def on_deleted(tid: object) -> None:  # also when deleted by `python -m privacy` in this process
            tenant = getattr(tid, "value", str(tid))
            invalidate()
            indexes.forget(tenant)
            if reuse is not None:
                reuse.forget(tenant)
            engine.forget_tenant(tenant)  # its cached KV too

        def gone_elsewhere(tenant: str) -> None:  # deleted through another replica
            engine.forget_tenant(tenant)

        store.add_deletion_hook(on_deleted)
        if self.cluster is not None:
            self.cluster.replica.on_tenant_gone(gone_elsewhere)
        self.metrics.watch_engine(engine)

        def close_history() -> None:
            if reuse is not None:
                reuse.close()
            history.close()

        backend = EngineBackend(engine, tokenizer, name, record_trajectory=indexes.record, on_close=close_history,
                                store_before_reply=c.server.store_before_reply,
                                on_store_wait=self.metrics.observe_store_wait, on_fatal=self._engine_died)
        return Decoding(backend, indexes, residency, history, engine, reuse)

    def _indexes(self, store: HistoryStore, proposer: object, accounting: TenantAccounting,
                 tokenize: Callable[[str], list[int]] | None) -> tuple[Indexes, TenantResidency]:
        """The tenants' indexes over ``proposer`` (the own engine's, or the proxy of the one in vLLM's
        worker) and what keeps a request's tenant in memory while it decodes: loaded at start-up within
        ``server.index_memory_bytes`` in one process; on a replica, loaded lazily from the shared store."""
        if self.cluster is not None:
            self.cluster.set_proposer(proposer)
            return self.cluster.indexes(accounting, self.metrics, tokenize), self.cluster.residency()
        indexes = TenantIndexes(store, proposer, accounting, self.metrics, tokenize,
                                memory_budget_bytes=self.config.server.index_memory_bytes)
        indexes.load_all()
        return indexes, IndexResidency(indexes)

    def _vllm(self, store: HistoryStore, invalidate: Callable[[], None]) -> Decoding:
        """The ``vllm`` decode backend, its tenants' indexes in vLLM's worker (shared through the store on
        a replica, as the own engine's), the history writer."""
        engine = self._vllm_engine if self._vllm_engine is not None else start_vllm_engine(self.config)
        try:
            tenants, tokenizer = attach_tenants(engine, self.config, store)
            tokenize = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
            accounting = TenantAccounting(holdout=self.holdout)
            indexes, residency = self._indexes(store, tenants if tenants is not None else object(), accounting,
                                               tokenize)
            history = self.cluster.writer if self.cluster is not None else HistoryWriter(store)
            backend = vllm_backend(engine, tokenizer, self.config, accounting, self.metrics, history.put,
                                   indexes.record, index_turns=self.cluster is None, on_close=history.close,
                                   on_fatal=self._engine_died)
        except BaseException:
            if self._vllm_engine is None:
                engine.close()
            raise

        def on_deleted(tid: object) -> None:
            invalidate()
            indexes.forget(getattr(tid, "value", str(tid)))

        store.add_deletion_hook(on_deleted)
        return Decoding(backend, indexes, residency, history)

    @property
    def history(self) -> HistoryWriter | ReplicaWriter | None:
        return self.decoding.history if self.decoding is not None else None

    @property
    def indexes(self) -> Indexes | None:
        return self.decoding.indexes if self.decoding is not None else None

    @property
    def reuse(self) -> ReuseWiring | None:
        return self.decoding.reuse if self.decoding is not None else None

    # ---- health and failure --------------------------------------------------------------------------

    def health(self, service: str = "") -> str:
        """What ``service`` can do now: "serving", "draining", "engine stopped" or "unknown service".
        ``""`` is the whole service, else a gRPC plane's name (the admin plane needs no engine). The one
        answer both /healthz (``?service=``) and gRPC health give (``GrpcServer.refresh_health``)."""
        if service not in ("", *SERVICE_NAMES):
            return "unknown service"
        if self.core is None or self.core.admission.draining:
            return "draining"
        if service == ADMIN_PLANE or self.core.backend.alive:
            return "serving"
        return "engine stopped"

    def _engine_died(self, error: BaseException) -> None:
        """From the dying engine's thread: NOT_SERVING at once, then stop with a non-zero exit code."""
        self.exit_code = EXIT_ENGINE_FAILED
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def fail() -> None:
            log.critical("the engine died (%s): health is NOT_SERVING; stopping with exit code %d",
                         type(error).__name__, EXIT_ENGINE_FAILED)
            if self.grpc is not None:
                await self.grpc.refresh_health()
                self.grpc.request_stop()

        try:
            asyncio.run_coroutine_threadsafe(fail(), loop)
        except RuntimeError:  # the loop has closed meanwhile
            pass

    # ---- running and stopping ------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        assert self.grpc is not None
        self.grpc.install_signal_handlers()

    async def wait(self) -> None:
        assert self.grpc is not None
        await self.grpc.wait()
        await self._after_grpc()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown; idempotent."""
        if self.grpc is not None:
            await self.grpc.stop(grace)
        await self._after_grpc()

    async def _after_grpc(self) -> None:
        if self.stats_history is not None:
            self.stats_history.stop()
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.core is not None:
            core, self.core = self.core, None
            await core.close()  # the engine stops, queued history is written
        if self.cluster is not None:
            self.cluster.stop()
        if self.store is not None:
            self.store.close()
            self.store = None
