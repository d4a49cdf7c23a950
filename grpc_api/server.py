"""The gRPC server: both planes, health checking, reflection, limits, keepalive, graceful shutdown.

    server = GrpcServer(core, admin_backend, authenticator, settings, metrics)
    port = await server.start()
    await server.wait()            # until SIGTERM/SIGINT (install_signal_handlers) or stop()

``core`` is the serving core (``serving.core.ServingCore``) the data plane adapts; ``settings`` is any
object with the attributes of ``reprise.config.ServerConfig`` (host, grpc_port, max_message_bytes,
max_concurrent_requests, grace_seconds, keepalive_time_s, keepalive_timeout_s, public_streams_total,
public_streams_per_connection, admin_max_calls, grpc_message_timeout_s, grpc_pending_per_connection,
grpc_pending_per_address, grpc_pending_total, tls_cert_file, tls_key_file, tls_client_ca_file).

Capacity: grpc's own ``maximum_concurrent_rpcs`` is not used. It counts a call from its headers, before
credentials can be checked against its message, and it is one count for every service, so calls that
never send a message once held all of it. Instead the interceptor checks credentials from the headers
and refuses a call without a valid key at once; a call waits for its message under per-connection,
per-address and total caps and a deadline; and once at work it holds a slot of its own plane (data,
admin, public), so health checks and the admin plane keep room whatever the data plane's callers do
(``grpc_api.capacity``). Authenticated generation is further admitted by the core (per tenant and in
total).

Shutdown (``stop``): health turns NOT_SERVING for every service, new generation requests get
UNAVAILABLE, in-flight streams have ``grace_seconds`` to finish and are then cancelled. The caller
then closes the core (the engine stops, history is flushed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

from grpc_api.admin import AdminServicer
from grpc_api.capacity import Capacity
from grpc_api.decoding import DecodingServicer
from grpc_api.interceptors import ADMIN_PLANE, DATA_PLANE, NullMetrics, ServerInterceptor
from grpc_api.v1 import admin_pb2, admin_pb2_grpc, decoding_pb2, decoding_pb2_grpc
from serving.admin import AdminBackend
from serving.core import ServingCore
from serving.records import Authenticator

log = logging.getLogger(__name__)
SERVICE_NAMES = (DATA_PLANE, ADMIN_PLANE)
# grpcio-reflection serves v1alpha only; current tools (grpcurl, Postman) ask for v1 first. The two
# versions' messages are identical on the wire, so v1 is served by the same servicer under its own name.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def add_reflection_v1(names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Serve reflection under ``grpc.reflection.v1`` too, listing ``names``."""
    servicer = ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1,
                                                                          {"ServerReflectionInfo": handler}),))


def server_options(settings: Any) -> list[tuple[str, Any]]:
    """Channel arguments: bounded messages, keepalive, no silent port sharing."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Long unary calls send no data for a while; let clients ping that often (vLLM uses 10 s).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        # Without this a second server binds the same port on Linux and steals half the connections.
        ("grpc.so_reuseport", 0),
    ]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """Both planes on one port, with health checking and reflection."""

    def __init__(self, core: ServingCore, admin: AdminBackend, authenticator: Authenticator, settings: Any,
                 metrics: Any = None, version: str = "", health: Callable[[str], str] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.core = core
        self.admission = core.admission
        self._admin = admin
        self._auth = authenticator
        self._version = version
        self._health_of = health or self._default_health
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._stopped = asyncio.Event()
        self._stopping: asyncio.Task | None = None
        self._admin_executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="reprise-admin")
        self.capacity = Capacity.for_settings(settings)

    async def start(self) -> int:
        """Bind and start serving; return the bound port (useful with grpc_port 0)."""
        s = self.settings
        # No maximum_concurrent_rpcs: the interceptor holds every call to its plane's capacity (module
        # docstring); grpc's one count for all services is what let headers alone shut everyone out.
        server = grpc.aio.server(interceptors=[ServerInterceptor(self._auth, self.metrics, self.capacity)],
                                 options=server_options(s))
        decoding_pb2_grpc.add_DecodingServiceServicer_to_server(DecodingServicer(self.core, self._version), server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            AdminServicer(self._admin, self.admission, self._admin_executor, s.max_message_bytes), server)
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (
            decoding_pb2.DESCRIPTOR.services_by_name["DecodingService"].full_name,
            admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
            REFLECTION_V1,
        )
        reflection.enable_server_reflection(names, server)
        add_reflection_v1(names, server)
        address = _address(s.host, s.grpc_port)
        try:
            if s.tls_cert_file:
                ca = Path(s.tls_client_ca_file).read_bytes() if s.tls_client_ca_file else None
                creds = grpc.ssl_server_credentials(
                    [(Path(s.tls_key_file).read_bytes(), Path(s.tls_cert_file).read_bytes())],
                    root_certificates=ca, require_client_auth=ca is not None)
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (in use?)")
        await server.start()
        self._server = server
        await self.refresh_health()
        log.info("gRPC serving on %s", _address(s.host, self.port))
        return self.port

    def _default_health(self, service: str) -> str:
        return "draining" if self.admission.draining else "serving"

    async def refresh_health(self) -> None:
        """Health checking's answer for each service name, from ``health(name)`` (the function /healthz
        reads too, so both fronts say the same): SERVING where it says "serving", else NOT_SERVING. Call
        it when that answer changes (the engine died); draining turns every name NOT_SERVING itself."""
        if self._health is not None:
            for name in ("", *SERVICE_NAMES):
                serving = self._health_of(name) == "serving"
                await self._health.set(name, health_pb2.HealthCheckResponse.SERVING if serving
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start a graceful stop (once)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        if self._stopping is None:
            log.warning("stopping: draining in-flight requests for up to %.1f s", self.settings.grace_seconds)
            self._stopping = asyncio.get_running_loop().create_task(self.stop())

    async def wait(self) -> None:
        """Until the server has stopped."""
        await self._stopped.wait()
        if self._stopping is not None:
            await self._stopping

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown (see the module docstring). Idempotent."""
        if self._server is None or self._stopped.is_set():
            return
        grace = self.settings.grace_seconds if grace is None else grace
        self.admission.draining = True
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        # Streams still running after the grace period are cancelled by grpc; their workers see the
        # cancel events set below and return at their next step. HTTP requests (the same admission)
        # get what is left of the grace period.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self._server.stop(grace)
        await self.admission.wait_idle(max(0.0, deadline - loop.time()))
        self.admission.cancel_all()
        await loop.run_in_executor(None, self._admin_executor.shutdown, True)
        self._stopped.set()
        log.info("gRPC server stopped")
