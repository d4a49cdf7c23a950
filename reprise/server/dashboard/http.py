"""The service's HTTP side: Prometheus metrics, a liveness probe and the hit-rate dashboard.

    GET /metrics               Prometheus text format (no tenant ids in any label; no credentials)
    GET /healthz               200 "serving", 503 "draining"
    GET /dashboard             the page: a static shell, no data; draws its charts with inline SVG
    GET /dashboard/api/stats   the page's data; needs ``Authorization: Bearer <admin key>``

The page takes the admin key from its URL fragment (``/dashboard#key=rpa_...``: fragments never reach
the server or its logs) or from a form, keeps it in sessionStorage, and sends it as a bearer header.
No external scripts, styles or fonts: a strict Content-Security-Policy with a per-response nonce.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from grpc_api.backend import Authenticator
from grpc_api.interceptors import bearer_key

log = logging.getLogger(__name__)
PAGE = resources.files("reprise.server.dashboard").joinpath("page.html").read_text(encoding="utf-8")


class HttpServer:
    """A small threaded HTTP server beside the gRPC port (``server.http_port``)."""

    def __init__(self, host: str, port: int, authenticator: Authenticator, snapshot: Callable[[], dict[str, Any]],
                 render_metrics: Callable[[], tuple[bytes, str]], is_draining: Callable[[], bool] = lambda: False,
                 ) -> None:
        app = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "reprise"
            sys_version = ""

            def do_GET(self) -> None:
                app._get(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http %s " + fmt, self.address_string(), *args)

        self._auth = authenticator
        self._snapshot = snapshot
        self._render_metrics = render_metrics
        self._is_draining = is_draining
        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="reprise-http", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever: only when it runs
            self._httpd.shutdown()
            self._thread.join(5)
            self._thread = None
        self._httpd.server_close()

    # ---- routes ------------------------------------------------------------------------------------

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = self._render_metrics()
            return _send(h, 200, body, ctype)
        if path == "/healthz":
            draining = self._is_draining()
            return _send(h, 503 if draining else 200, b"draining\n" if draining else b"serving\n", "text/plain")
        if path in ("", "/"):
            return _send(h, 302, b"", "text/plain", {"Location": "/dashboard"})
        if path in ("/dashboard", "/dashboard/"):
            nonce = secrets.token_urlsafe(16)
            csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
                   "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                   "frame-ancestors 'none'")
            body = PAGE.replace("{{NONCE}}", nonce).encode()
            return _send(h, 200, body, "text/html; charset=utf-8", {"Content-Security-Policy": csp})
        if path == "/dashboard/api/stats":
            key = bearer_key([("authorization", h.headers.get("Authorization", ""))]
                             if h.headers.get("Authorization") is not None else [])
            principal = self._auth.authenticate(key) if key else None
            if principal is None:
                return _json(h, 401, {"error": "send 'Authorization: Bearer <admin key>'"},
                             {"WWW-Authenticate": 'Bearer realm="reprise"'})
            if principal.kind != "admin":
                return _json(h, 403, {"error": "the dashboard needs an admin key; this key belongs to a tenant"})
            try:
                return _json(h, 200, self._snapshot())
            except Exception:
                log.exception("dashboard: building the statistics failed")
                return _json(h, 500, {"error": "internal error; see the server log"})
        return _json(h, 404, {"error": f"no page {path}"})


def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str,
          headers: dict[str, str] | None = None) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    h.send_header("Cache-Control", "no-store")
    h.send_header("X-Content-Type-Options", "nosniff")
    h.send_header("Referrer-Policy", "no-referrer")
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


def _json(h: BaseHTTPRequestHandler, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
    _send(h, status, json.dumps(data, separators=(",", ":")).encode(), "application/json", headers)
