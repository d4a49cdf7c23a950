"""The service's error vocabulary, protocol-neutral: what went wrong, in words a caller can act on.

Everything below the fronts (the serving core, the backends, the tenant store's adapters) raises these,
or a plain ``ValueError`` (read as ``InvalidArgument``). Each front maps the classes to its own wire
once: gRPC status codes in ``grpc_api.status``, HTTP statuses and OpenAI error objects in
``http_api.errors``. ``param`` names the request field at fault, so an HTTP error object's ``param`` is
filled in.

Field names: a front's own parsers name fields as their caller spelled them. Below the fronts (the
serving core, the backends) an error about a request field is made with ``about``: its ``param`` and its
message name fields by the request record's own names (``max_new_tokens``, ``messages[2].role``,
``tools[1].parameters``: ``serving.records.Request``), and each front words it in its caller's names
where the error comes back to it (``spelled``, with the front's ``spelling`` of those names: OpenAI's
``max_completion_tokens``, gRPC's ``stopping.max_new_tokens``). No table of names travels down.

    raise errors.InvalidArgument.about("top_p", lambda name: f"{name('top_p')} must be in (0, 1]")
    with errors.spelled(SPELLING):   # a front, around its calls into the core
        request = core.prepare(request)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

Spelling = Callable[[str], str]
"""A front's name for a request field, given the field's neutral path (``max_new_tokens`` ->
``max_tokens``; ``messages[2].role`` -> ``input.messages[2].role``)."""
Wording = Callable[[Spelling], str]
"""An error's message, written with the fields it names spelled through the given ``Spelling``."""

def _neutral(path: str) -> str:
    return path


class ServiceError(Exception):
    """An error with a message for the caller and, when one field is at fault, its name (``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self._wording: Wording | None = None  # set by ``about``: not yet in a front's names

    @classmethod
    def about(cls, param: str, wording: Wording | str) -> Self:
        """An error about the request field ``param`` (its neutral path) whose message names fields
        through the spelling it is given (a plain string names none). Until a front ``spell``s it, its
        message and ``param`` use the neutral names."""
        words = wording if callable(wording) else (lambda _name: wording)
        exc = cls(words(_neutral), param=param)
        exc._wording = words
        return exc

    def spell(self, spelling: Spelling) -> None:
        """Word this error in a front's field names (once; an error not made by ``about`` is left as it is)."""
        if self._wording is None:
            return
        self.message = self._wording(spelling)
        self.args = (self.message,)
        self.param = spelling(self.param) if self.param is not None else None
        self._wording = None


class InvalidArgument(ServiceError):
    """A bad parameter or input; ``param`` names it."""


class OutOfRange(ServiceError):
    """Prompt plus max_new_tokens beyond the model's context."""


class Unauthenticated(ServiceError):
    """No credentials, or a key that is unknown or revoked."""


class PermissionDenied(ServiceError):
    """A known principal without the role the call needs."""


class NotFound(ServiceError):
    """Unknown model, request, stored response or tenant (never says whether another tenant's exists);
    ``what`` names which of them (``"model"``, ``"response"``, ...), for fronts that say it in a code."""

    def __init__(self, message: str, param: str | None = None, *, what: str = "") -> None:
        super().__init__(message, param)
        self.what = what


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


def bad_field(field: str, rest: str, sep: str = " ") -> InvalidArgument:
    """An InvalidArgument about ``field`` (a neutral path) whose message is its name, ``sep``, ``rest``."""
    return InvalidArgument.about(field, lambda name: f"{name(field)}{sep}{rest}")


def spelling(names: Mapping[str, str]) -> Spelling:
    """A front's ``Spelling`` from its table: a neutral field path (or a path's start, up to a ``.`` or
    ``[``) -> the front's; ``{i}`` in a key stands for an index and is passed on (``"tools[{i}]":
    "tools[{i}].function"``). The longest key that starts a path decides; a path no key starts is kept."""
    patterns = [(re.compile(re.escape(key).replace(r"\{i\}", r"(?P<i>\d+)") + r"(?=$|[.\[])"), names[key])
                for key in sorted(names, key=len, reverse=True)]

    def spell(path: str) -> str:
        for pattern, name in patterns:
            match = pattern.match(path)
            if match:
                index = match.groupdict().get("i")
                return (name.format(i=index) if index is not None else name) + path[match.end():]
        return path

    return spell


@contextlib.contextmanager
def spelled(spell: Spelling) -> Iterator[None]:
    """A front's edge: a ``ServiceError`` raised inside leaves worded in the front's field names."""
    try:
        yield
    except ServiceError as exc:
        exc.spell(spell)
        raise
