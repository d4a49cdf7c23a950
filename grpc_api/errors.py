"""Errors a backend raises to give a caller a precise gRPC status.

Backends (the decode pipeline, the tenant store) raise these, or a plain ``ValueError`` (mapped to
INVALID_ARGUMENT); anything else becomes INTERNAL with a generic message (details go to the server log,
never to the caller). The mapping happens in one place: ``grpc_api.interceptors``.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An error with the gRPC status it should reach the caller as."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(ServiceError):
    """Prompt plus max_new_tokens beyond the model's context."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    """A limit is reached; ``retry_after_s`` travels to the caller as google.rpc.RetryInfo."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ServiceError):
    """Draining or the model is down: retryable elsewhere or later."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ServiceError):
    """A stored record failed its integrity check."""

    code = grpc.StatusCode.DATA_LOSS


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


class Aborted(ServiceError):
    """An operation broke off (an upload that ended early, a conflict); nothing of it was kept."""

    code = grpc.StatusCode.ABORTED
