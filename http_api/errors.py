"""Errors as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status an OpenAI client maps to its exception classes (400 BadRequestError, 401 AuthenticationError,
403 PermissionDeniedError, 404 NotFoundError, 413, 429 RateLimitError with Retry-After, 503 while
draining). The service's errors (``serving.errors``) map here by class, as they map to gRPC codes in
``grpc_api.status``; ``param`` is the field at fault as the caller spelled it (an error from the core is
worded in the body's names first: ``spelling``). Anything else is a 500 whose details stay in the
server log."""

from __future__ import annotations

import logging
import math

from http_api.body import BodyTooLarge
from serving import errors

log = logging.getLogger(__name__)


# class -> (HTTP status, OpenAI error type, code)
_STATUS: list[tuple[type[errors.ServiceError], int, str, str | None]] = [
    (BodyTooLarge, 413, "invalid_request_error", "request_too_large"),
    (errors.InvalidArgument, 400, "invalid_request_error", None),
    (errors.OutOfRange, 400, "invalid_request_error", "context_length_exceeded"),
    (errors.FailedPrecondition, 400, "invalid_request_error", None),
    (errors.Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (errors.PermissionDenied, 403, "permission_error", None),
    (errors.NotFound, 404, "not_found_error", None),  # code: "<what>_not_found" (model_not_found, ...)
    (errors.AlreadyExists, 409, "invalid_request_error", None),
    (errors.ResourceExhausted, 429, "rate_limit_error", "rate_limit_exceeded"),
    (errors.Unavailable, 503, "service_unavailable", None),
    (errors.DataLoss, 500, "server_error", None),
    (errors.Aborted, 409, "invalid_request_error", None),
    (errors.Internal, 500, "server_error", None),
]


def error_body(exc: BaseException, spelling: errors.Spelling | None = None) -> tuple[int, dict, dict[str, str]]:
    """(status, body, headers) of an error; ``spelling``: how the request named the fields the core's
    errors name (``http_api.chat.spelling``)."""
    if isinstance(exc, ValueError) and not isinstance(exc, errors.ServiceError):
        exc = errors.InvalidArgument(str(exc))
    if isinstance(exc, errors.ServiceError) and spelling is not None:
        exc.spell(spelling)
    headers: dict[str, str] = {}
    for cls, status, kind, code in _STATUS:
        if isinstance(exc, cls):
            if isinstance(exc, errors.ResourceExhausted):
                headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            if isinstance(exc, errors.Unauthenticated):
                headers["WWW-Authenticate"] = 'Bearer realm="reprise"'
            if isinstance(exc, errors.NotFound) and exc.what:
                code = f"{exc.what}_not_found"
            return status, body(exc.message, kind, code, exc.param), headers
    log.error("internal error answering an HTTP request", exc_info=exc)
    return 500, body("internal error; see the server log", "server_error", None), headers


def body(message: str, kind: str, code: str | None, param: str | None = None) -> dict:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
