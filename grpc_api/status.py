"""The gRPC status of each of the service's errors (``serving.errors``): the table lives here, in the
gRPC adapter, as the HTTP statuses live in ``http_api.errors``."""

from __future__ import annotations

import grpc

from serving import errors

_CODES: list[tuple[type[errors.ServiceError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DataLoss, grpc.StatusCode.DATA_LOSS),
    (errors.Aborted, grpc.StatusCode.ABORTED),
    (errors.Internal, grpc.StatusCode.INTERNAL),
]


def status_code(exc: errors.ServiceError) -> grpc.StatusCode:
    """The status ``exc`` reaches a gRPC caller as (INTERNAL for an error class not in the table)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL
