"""The whole service, wired from one ``ServiceConfig``: what `reprise serve` runs.

    service = Service(config)            # or Service(config, model=LoadedModel(...)) in tests
    await service.start()                # store, model, engine thread, gRPC, HTTP, stats sampler
    await service.wait()                 # until SIGTERM/SIGINT (install_signal_handlers) or stop()

Start-up order: the encrypted store (and, on first start, the admin key file), the model, the engine on
its own thread, the tenants' indexes, the gRPC server (data and admin planes), the HTTP server
(the OpenAI-compatible API under /v1, /metrics, /healthz, /dashboard; reprise/server/http.py). Shutdown (``stop``) reverses it: health NOT_SERVING, in-flight streams finish
within the grace period, the engine stops, queued history is written, the store closes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

from grpc_api.server import GrpcServer
from privacy import ensure_admin_key, open_store
from reprise import __version__
from reprise.backends.engine import EngineBackend
from reprise.cluster.node import ClusterNode
from reprise.config import ServiceConfig
from reprise.drafters import DEFAULT_DRAFTER, make_proposer
from reprise.engine.engine import Engine, EngineConfig
from reprise.server.admin import ServiceAdmin
from reprise.server.auth import StoreAuthenticator
from reprise.server.dashboard import StatsHistory
from reprise.server.hidden_store import ReuseWiring
from reprise.server.history_writer import HistoryWriter
from reprise.server.http import HttpServer, build_app
from reprise.server.indexes import TenantIndexes
from reprise.server.metering import StepMeter, TenantAccounting
from reprise.server.metrics import ServiceMetrics
from reprise.server.tenant_config import apply_tenant_configs
from reprise.server.vllm import start_vllm
from verifier.models import configure_threads, load_default_model, load_model, served_model_name
from verifier.runner import ModelRunner

log = logging.getLogger(__name__)


def load_target_model(config: ServiceConfig) -> Any:
    """The configured model (a ``verifier.models.LoadedModel``): a local folder or the default SmolLM2."""
    m = config.model
    if m.path:
        return load_model(m.path, dtype=m.dtype, device=m.device, num_threads=m.num_threads)
    return load_default_model(num_threads=m.num_threads, device=m.device)


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


class Service:
    """Store + model engine + indexes + gRPC + HTTP, started and stopped together."""

    def __init__(self, config: ServiceConfig, *, model: Any = None, model_name: str = "") -> None:
        self.config = config
        self._model = model
        self._model_name = model_name
        self.store: Any = None
        self.metrics: Any = None
        self.grpc: Any = None
        self.http: Any = None
        self._app: Any = None  # the HTTP side (reprise.server.http.build_app), served once started
        self.history: Any = None
        self.reuse: Any = None  # reprise.server.hidden_store.ReuseWiring when the drafter keeps hidden-state reuse
        self.stats_history: Any = None
        self.admin_key_file: Path | None = None
        self.cluster: Any = None  # reprise.cluster.ClusterNode when cluster.enabled

    # ---- start-up ------------------------------------------------------------------------------------

    async def start(self) -> None:
        check_port_free(self.config.server.host, self.config.server.grpc_port)  # before the slow part
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._build)
        self.grpc_port = await self.grpc.start()
        self.http_port = await self.http.start(self._app) if self.http is not None else 0
        self.stats_history.start()
        if self.cluster is not None:
            admission = self.grpc.admission  # runs on the event loop: deletions elsewhere cancel from here
            self.cluster.replica.on_tenant_gone(lambda t: loop.call_soon_threadsafe(admission.cancel_tenant, t))
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
        self.metrics = ServiceMetrics()
        self.store = open_store(c.store)
        decode = None
        try:
            if c.cluster.enabled:  # replicas on one Redis (reprise.cluster, docs/cluster.md)
                self.cluster = ClusterNode(c.cluster, self.store, None, self.metrics)
            auth = self.cluster.authenticator() if self.cluster else StoreAuthenticator(self.store)
            if c.server.http_port:  # bind now: the HTTP port is free before the store writes anything
                self.http = HttpServer(c.server.host, c.server.http_port)
            self.admin_key_file = ensure_admin_key(self.store)
            if self.admin_key_file is not None:
                log.warning("first start: the admin key is in %s (0600); `reprise tenant ...` reads it there",
                            self.admin_key_file)
            if c.model.engine == "vllm":  # vLLM decodes, Reprise drafts in its worker (docs/vllm.md)
                decode = self._build_vllm(auth)
            else:
                if c.model.device == "cpu":  # also for a model handed in: two replicas' thread pools would fight
                    configure_threads(c.model.num_threads)
                model = getattr(loaded, "model", loaded)
                tokenizer = getattr(loaded, "tokenizer", None)
                name = self._model_name or served_model_name(getattr(loaded, "source", "") or "model")
                runner = ModelRunner(model, num_slots=c.model.num_slots, max_len=c.model.max_len,
                                     max_draft_nodes=c.model.max_draft_nodes,
                                     prefix_cache_bytes=c.model.prefix_cache_bytes)
                accounting = TenantAccounting(runner.prefix_cache)
                inner = make_proposer(c.model.drafter or DEFAULT_DRAFTER, c.drafting)
                if tokenizer is not None and hasattr(inner, "set_vocabulary"):  # numbers match by class
                    inner.set_vocabulary(lambda i: tokenizer.decode([i]), runner.vocab_size)
                tuned = apply_tenant_configs(inner, self.store.list_tenants(), c.home)  # `reprise tune`'s
                if tuned:
                    log.info("%d tenants draft with their own tuned settings", tuned)
                tokenize = (lambda text: list(tokenizer.encode(text, add_special_tokens=False))) if tokenizer else None
                if self.cluster is not None:
                    self.cluster.set_proposer(inner)
                    proposer = self.cluster.engine_proposer(inner)
                    self.indexes = self.cluster.indexes(accounting, self.metrics, tokenize)
                else:
                    proposer = inner
                    self.indexes = TenantIndexes(self.store, inner, accounting, self.metrics, tokenize)
                self.indexes.load_all()
                reuse = ReuseWiring.find(inner)
                if reuse is not None:  # hidden-state reuse vectors are tenant history: sealed, restored
                    self.reuse = ReuseWiring(reuse, self.store)
                    log.info("restored %d hidden-state segments", self.reuse.restore_all(self.store.list_tenants()))

                def on_deleted(tid: Any) -> None:  # also when deleted by `python -m privacy` in this process
                    auth.invalidate()
                    self.indexes.forget(tid.value)
                    if self.reuse is not None:
                        self.reuse.forget(tid.value)

                self.store.add_deletion_hook(on_deleted)
                self.history = self.cluster.writer if self.cluster is not None else HistoryWriter(self.store)
                engine = Engine(runner, proposer, tokenizer,
                                EngineConfig(history_sink=self.history.put, observer=StepMeter(accounting, self.metrics)))
                self.store.add_deletion_hook(lambda tid: engine.forget_tenant(tid.value))  # its cached KV too
                if self.cluster is not None:
                    self.cluster.replica.on_tenant_gone(engine.forget_tenant)
                self.metrics.watch_engine(engine)
                decode = EngineBackend(engine, tokenizer, name, record_trajectory=self.indexes.record,
                                       on_close=self._close_history, store_before_reply=c.server.store_before_reply,
                                       on_store_wait=self.metrics.observe_store_wait)
                if self.cluster is not None:
                    decode = self.cluster.backend(decode)
            admin = ServiceAdmin(self.store, self.indexes, auth.invalidate)
            self.grpc = GrpcServer(decode, admin, auth, c.server, self.metrics, version=__version__)
            self.stats_history = StatsHistory(lambda: admin.index_stats(None), admin.list_tenants,
                                              interval_s=c.server.stats_interval_s)
            grpc = self.grpc
            self._app = build_app(auth, self.stats_history.snapshot, self.metrics.render,
                                  lambda: grpc.admission.draining, grpc.front, c.server.max_message_bytes,
                                  self.metrics)
        except BaseException:
            if decode is not None:
                decode.close()  # stops the engine thread, writes queued history
            else:
                if self.reuse is not None:
                    self.reuse.close()
                if self.history is not None:
                    self.history.close()
            if self.cluster is not None:
                self.cluster.stop()
            if self.http is not None:
                self.http.close()
                self.http = None
            self.store.close()
            self.store = None
            raise

    def _build_vllm(self, auth: Any) -> Any:
        """The ``vllm`` decode backend, its tenants' indexes in vLLM's worker, the history writer."""
        self.history = HistoryWriter(self.store)
        decode, self.indexes = start_vllm(self.config, self.store, TenantAccounting(), self.metrics,
                                          self.history.put, on_close=self._close_history)

        def on_deleted(tid: Any) -> None:
            auth.invalidate()
            self.indexes.forget(tid.value)

        self.store.add_deletion_hook(on_deleted)
        return decode

    def _close_history(self) -> None:
        if self.reuse is not None:
            self.reuse.close()
        self.history.close()

    # ---- running and stopping ------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        self.grpc.install_signal_handlers()

    async def wait(self) -> None:
        await self.grpc.wait()
        await self._after_grpc()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown; idempotent."""
        await self.grpc.stop(grace)
        await self._after_grpc()

    async def _after_grpc(self) -> None:
        if self.stats_history is not None:
            self.stats_history.stop()
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.cluster is not None:
            self.cluster.stop()
        if self.store is not None:
            self.store.close()
            self.store = None
