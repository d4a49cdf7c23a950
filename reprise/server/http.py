"""The service's HTTP side on one ASGI app (FastAPI, served by uvicorn on the service's event loop):

    GET  /metrics               Prometheus text format (no tenant ids in any label; no credentials)
    GET  /healthz               200 "serving", 503 "draining"
    GET  /dashboard, /dashboard/api/stats     the hit-rate page and its data (admin key)
    POST /v1/chat/completions, /v1/completions; GET /v1/models     the OpenAI-compatible API (tenant keys)

uvicorn runs as a task on the same event loop as the gRPC server: both fronts share one admission
(``grpc_api.admission.Admission`` runs on that loop), so per-tenant and global limits count requests of
both APIs together. The socket is bound when the server is built, so a port in use fails before the
model loads. Every response carries ``Cache-Control: no-store`` (except event streams), ``nosniff`` and
``no-referrer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from grpc_api import errors
from grpc_api.backend import Authenticator
from reprise.server.dashboard.http import dashboard_router
from reprise.server.openai_api import openai_router
from reprise.server.openai_api.errors import error_body

log = logging.getLogger(__name__)


def build_app(authenticator: Authenticator, snapshot: Callable[[], dict[str, Any]],
              render_metrics: Callable[[], tuple[bytes, str]], is_draining: Callable[[], bool] = lambda: False,
              front: Any = None, max_body_bytes: int = 16 << 20, metrics: Any = None) -> FastAPI:
    """The app; ``front`` (a ``grpc_api.front.DecodeFront``) adds the ``/v1`` API; ``metrics`` (with
    ``observe_http(route, status, seconds)``) counts every request by its route's template."""
    app = FastAPI(title="reprise", docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(_SecurityHeaders, observe=metrics.observe_http if metrics is not None else None)

    @app.exception_handler(errors.ServiceError)
    @app.exception_handler(ValueError)
    async def service_error(request: Request, exc: Exception) -> Response:
        status, body, extra = error_body(exc)
        return JSONResponse(body, status, extra)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no page {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            exc.status_code)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        body, ctype = render_metrics()
        return Response(body, media_type=ctype)

    @app.get("/healthz")
    async def healthz() -> Response:
        draining = is_draining()
        return PlainTextResponse("draining\n" if draining else "serving\n", 503 if draining else 200)

    @app.get("/")
    async def root() -> Response:
        return RedirectResponse("/dashboard", 302)

    app.include_router(dashboard_router(authenticator, snapshot))
    if front is not None:
        app.include_router(openai_router(front, authenticator, max_body_bytes))
    return app


class _SecurityHeaders:
    """Pure ASGI middleware (it does not buffer or wrap streams): ``no-store`` except on event streams,
    ``nosniff`` and ``no-referrer`` on every response; each request's route, status and time to ``observe``."""

    def __init__(self, app: Any, observe: Callable[[str, int, float], None] | None = None) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_headers(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                if not headers.get("content-type", "").startswith("text/event-stream"):
                    headers.setdefault("cache-control", "no-store")
                headers["x-content-type-options"] = "nosniff"
                headers["referrer-policy"] = "no-referrer"
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            if self.observe is not None:
                route = scope.get("route")  # set by the router when a route matched
                self.observe(getattr(route, "path", "unmatched"), status, time.perf_counter() - start)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service owns SIGTERM/SIGINT (graceful drain)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class HttpServer:
    """An app on ``host:port`` (0 = any free port), bound at construction; ``await start(app)`` serves it
    on the running event loop, ``await stop()`` closes it."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self._sock.listen(1024)
        self.port = self._sock.getsockname()[1]
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self, app: FastAPI) -> int:
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, server_header=False)
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it
        log.info("HTTP serving on port %d", self.port)
        return self.port

    async def stop(self) -> None:
        if self._task is not None and self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)
            self._task = None
        self.close()

    def close(self) -> None:
        """Release the socket (also of a server never started)."""
        self._sock.close()
