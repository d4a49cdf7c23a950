"""The service's HTTP side on one ASGI app (FastAPI, served by ``http_api.server`` on the service's
event loop):

    GET  /healthz               200 "serving", 503 "draining" or "engine stopped" (no key: what a load
                                balancer reads, and nothing else is public); ``?service=NAME`` asks
                                about one gRPC plane (reprise.v1.DecodingService, reprise.v1.AdminService)
                                and answers exactly what gRPC health answers for that name (404: unknown)
    GET  /metrics               Prometheus text format, with an admin key (a scraper's bearer token):
                                per-tenant activity would show in its deltas
    POST /v1/chat/completions, /v1/completions, /v1/responses; GET /v1/models ...   the OpenAI-compatible
                                API (tenant keys; http_api.routes, http_api.responses)
    and the routers the application adds (the dashboard, with its admin key)

Both fronts share one serving core, so per-tenant and global limits count requests of both APIs
together. Every response carries ``Cache-Control: no-store`` (except event streams), ``nosniff`` and
``no-referrer``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from http_api.auth import principal
from http_api.errors import body, error_body
from http_api.responses import ResponseStore, responses_router
from http_api.routes import openai_router
from serving import errors
from serving.core import ServingCore
from serving.records import Authenticator


def build_app(core: ServingCore | None, authenticator: Authenticator, render_metrics: Callable[[], tuple[bytes, str]],
              health: Callable[[str], str], *, max_body_bytes: int = 16 << 20, routers: Sequence[APIRouter] = (),
              responses: ResponseStore | None = None,
              observe: Callable[[str, int, float], None] | None = None) -> FastAPI:
    """The app. ``health(service)`` says "serving", "draining", why not, or "unknown service" (``""``:
    the whole service), the same function gRPC health reads; ``core`` adds the ``/v1`` API (with
    ``responses``, the tenants' stored responses; None refuses ``store``); ``observe(route, status,
    seconds)`` counts every request by its route's template."""
    app = FastAPI(title="reprise", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_SecurityHeaders, observe=observe)

    @app.exception_handler(errors.ServiceError)
    @app.exception_handler(ValueError)
    async def service_error(request: Request, exc: Exception) -> Response:
        status, doc, extra = error_body(exc)
        return JSONResponse(doc, status, extra)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: Exception) -> Response:
        return JSONResponse(body("the request is nested too deeply", "invalid_request_error", None), 400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: Exception) -> Response:
        return JSONResponse(body("the request is not valid", "invalid_request_error", None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no page {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(body(message[:200], kind, None), exc.status_code)

    @app.get("/metrics")
    async def metrics_text(request: Request) -> Response:
        principal(authenticator, request, "admin")
        data, ctype = render_metrics()
        return Response(data, media_type=ctype)

    @app.get("/healthz")
    async def healthz(service: str = "") -> Response:
        state = health(service[:200])
        status = 200 if state == "serving" else 404 if state == "unknown service" else 503
        return PlainTextResponse(state + "\n", status)

    @app.get("/")
    async def root() -> Response:
        return RedirectResponse("/dashboard", 302)

    for router in routers:
        app.include_router(router)
    if core is not None:
        app.include_router(openai_router(core, authenticator, max_body_bytes))
        app.include_router(responses_router(core, authenticator, responses, max_body_bytes))
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
