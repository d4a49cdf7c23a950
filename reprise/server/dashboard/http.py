"""The hit-rate dashboard's routes (the service adds them to the HTTP app, ``http_api.app.build_app``).

    GET /dashboard             the page: a static shell, no data; draws its charts with inline SVG
    GET /dashboard/api/stats   the page's data; needs ``Authorization: Bearer <admin key>``

The page takes the admin key from its URL fragment (``/dashboard#key=rpa_...``: fragments never reach
the server or its logs) or from a form, keeps it in sessionStorage, and sends it as a bearer header.
No external scripts, styles or fonts: a strict Content-Security-Policy with a per-response nonce.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from http_api.auth import bearer_token
from serving.records import Authenticator

log = logging.getLogger(__name__)
PAGE = resources.files("reprise.server.dashboard").joinpath("page.html").read_text(encoding="utf-8")


def dashboard_router(authenticator: Authenticator, snapshot: Callable[[], dict[str, Any]]) -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard")
    @router.get("/dashboard/")
    async def page() -> Response:
        nonce = secrets.token_urlsafe(16)
        csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
               "frame-ancestors 'none'")
        return HTMLResponse(PAGE.replace("{{NONCE}}", nonce), headers={"Content-Security-Policy": csp})

    @router.get("/dashboard/api/stats")
    async def stats(request: Request) -> Response:
        key = bearer_token(request.headers.get("authorization"))
        if not key:
            return JSONResponse({"error": "send 'Authorization: Bearer <admin key>'"}, 401,
                                {"WWW-Authenticate": 'Bearer realm="reprise"'})
        principal = authenticator.authenticate(key)
        if principal is None:
            return JSONResponse({"error": "this admin key was not accepted (unknown or revoked): check it and try again"},
                                401, {"WWW-Authenticate": 'Bearer realm="reprise"'})
        if principal.kind != "admin":
            return JSONResponse({"error": "the dashboard needs an admin key; this key belongs to a tenant"}, 403)
        try:
            return JSONResponse(snapshot())
        except Exception:
            log.exception("dashboard: building the statistics failed")
            return JSONResponse({"error": "internal error; see the server log"}, 500)

    return router
