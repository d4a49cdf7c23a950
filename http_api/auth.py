"""Bearer keys on HTTP: ``Authorization: Bearer <key>`` to the principal it belongs to."""

from __future__ import annotations

from typing import Literal

from starlette.requests import Request

from serving import errors
from serving.records import Authenticator, Principal


def bearer_token(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header; None if absent; ``""`` if malformed."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else ""


def principal(authenticator: Authenticator, request: Request, kind: Literal["tenant", "admin"]) -> Principal:
    """The caller, who must hold a key of ``kind``: 401 without a usable key, 403 with the other kind."""
    key = bearer_token(request.headers.get("authorization"))
    if not key:
        what = "a tenant's API key ('Authorization: Bearer rpk_...')" if kind == "tenant" else \
            "an admin key ('Authorization: Bearer rpa_...')"
        raise errors.Unauthenticated(f"send {what}")
    who = authenticator.authenticate(key)
    if who is None:
        raise errors.Unauthenticated("the API key is unknown or revoked")
    if who.kind != kind:
        raise errors.PermissionDenied("an admin key cannot decode: use a tenant's API key" if kind == "tenant"
                                      else "this needs an admin key; this key belongs to a tenant")
    return who
