"""The service's error vocabulary, protocol-neutral: what went wrong, in words a caller can act on.

Everything below the fronts (the serving core, the backends, the tenant store's adapters) raises these,
or a plain ``ValueError`` (read as ``InvalidArgument``). Each front maps the classes to its own wire
once: gRPC status codes in ``grpc_api.status``, HTTP statuses and OpenAI error objects in
``http_api.errors``. ``param`` names the request field at fault, as the caller spelled it (the fronts'
parsers pass their own field names), so an HTTP error object's ``param`` is filled in.
"""

from __future__ import annotations


class ServiceError(Exception):
    """An error with a message for the caller and, when one field is at fault, its name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidArgument(ServiceError):
    """A bad parameter or input; ``param`` names it."""


class OutOfRange(ServiceError):
    """Prompt plus max_new_tokens beyond the model's context."""


class Unauthenticated(ServiceError):
    """No credentials, or a key that is unknown or revoked."""


class PermissionDenied(ServiceError):
    """A known principal without the role the call needs."""


class NotFound(ServiceError):
    """Unknown model, request, stored response or tenant (never says whether another tenant's exists)."""


class AlreadyExists(ServiceError):
    """A request id already in flight."""


class FailedPrecondition(ServiceError):
    """The call cannot work in the server's state (no chat template, no tokenizer, no history kept)."""


class ResourceExhausted(ServiceError):
    """A limit or quota is reached; ``retry_after_s`` travels to the caller (RetryInfo, Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0, param: str | None = None) -> None:
        super().__init__(message, param)
        self.retry_after_s = retry_after_s


class Unavailable(ServiceError):
    """Draining, or the engine or the store is down: retryable elsewhere or later."""


class DataLoss(ServiceError):
    """A stored record failed its integrity check."""


class Internal(ServiceError):
    """A bug; details stay in the server log."""


class Aborted(ServiceError):
    """An operation broke off (an upload that ended early, a conflict); nothing of it was kept."""



def invalid(message: str, param: str | None = None) -> InvalidArgument:
    """Shorthand for parsers: ``raise invalid(f"{name} must be ...", name)``."""
    return InvalidArgument(message, param)
