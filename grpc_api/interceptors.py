"""One server interceptor: authentication from the headers, the calls' capacity, the error-to-status
mapping, and RPC metrics.

Every handler is replaced by one that takes its requests as a stream (whatever the RPC's shape: on the
wire a unary request is a stream of one message), keeping the original's response shape and serializer,
so that nothing waits for a request message that may never come. For each call it

1. authenticates ``authorization: Bearer <key>`` from the call's headers, in ``intercept_service``,
   before the call waits for or counts anything: DecodingService wants a tenant key, AdminService an
   admin key (health checking and reflection need none); a call without a valid one is refused at once;
2. waits for the request message under ``grpc_api.capacity.PendingCalls``' caps and deadline, then
   takes a slot of its plane (``PlaneSlots``: data, admin and public each have their own) and, for an
   anonymous stream (``Health.Watch``, reflection), a place among ``PublicStreams``;
3. exposes the principal to the servicer through ``current_principal()``;
4. turns exceptions into statuses in one place: ``serving.errors`` -> its code (``grpc_api.status``;
   RESOURCE_EXHAUSTED with google.rpc.RetryInfo), ``ValueError`` -> INVALID_ARGUMENT, a late request
   message -> DEADLINE_EXCEEDED, anything else -> INTERNAL with a generic message (the traceback goes to
   the server log only);
5. counts ``grpc_server_started_total``, ``grpc_server_handled_total{grpc_code}`` and
   ``grpc_server_handling_seconds`` (refused calls included).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from grpc_api.capacity import Capacity, MessageTimeout, default_capacity
from grpc_api.status import status_code
from serving import errors
from serving.records import Authenticator, Principal

log = logging.getLogger(__name__)

DATA_PLANE = "reprise.v1.DecodingService"
ADMIN_PLANE = "reprise.v1.AdminService"
PUBLIC_PREFIXES = ("grpc.health.v1.", "grpc.reflection.")

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("reprise_principal", default=None)


def current_principal() -> Principal:
    """The authenticated caller of the RPC being handled (set by ``ServerInterceptor``)."""
    principal = _principal.get()
    if principal is None:  # a servicer reached without the interceptor: a wiring bug
        raise errors.Internal("no authenticated principal")
    return principal


class NullMetrics:
    """Metrics sink that records nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def bearer_key(metadata: Any) -> str | None:
    """The key of an ``authorization: Bearer <key>`` entry; None if absent; ``""`` if malformed."""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key.lower() == "authorization":
            if isinstance(value, bytes):
                return ""
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return None


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "bidi_stream" if handler.response_streaming else "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _status_trailers(exc: errors.ServiceError) -> tuple[tuple[str, Any], ...]:
    if not isinstance(exc, errors.ResourceExhausted):
        return ()
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=exc.message, details=[detail])
    return tuple(rpc_status.to_status(status).trailing_metadata)


_EMPTY = object()  # a request stream that ended before its first message


def plane_of(service: str) -> str:
    """The plane a service belongs to: ``public`` (health, reflection), ``admin`` or ``data``."""
    if service.startswith(PUBLIC_PREFIXES):
        return "public"
    return "admin" if service == ADMIN_PLANE else "data"


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Authentication, the calls' capacity, error mapping and metrics for every RPC (see the module
    docstring)."""

    def __init__(self, authenticator: Authenticator, metrics: Any = None, capacity: Capacity | None = None) -> None:
        self._auth = authenticator
        self._metrics = metrics if metrics is not None else NullMetrics()
        self.capacity = capacity if capacity is not None else default_capacity()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        full = handler_call_details.method  # "/package.Service/Method"
        service, _, method = full.strip("/").rpartition("/")
        plane = plane_of(service)
        labels = (service, method, _rpc_type(handler))
        try:
            principal = self._authenticate(plane, full, handler_call_details.invocation_metadata)
        except errors.ServiceError as exc:
            return self._refusal(handler, labels, full, exc)
        return self._wrap(handler, labels, full, plane, principal)

    def _authenticate(self, plane: str, method: str, metadata: Any) -> Principal | None:
        """The caller's principal from the call's headers (None on the public plane)."""
        if plane == "public":
            return None
        key = bearer_key(metadata)
        if key is None:
            raise errors.Unauthenticated("missing credentials: send metadata 'authorization: Bearer <key>'")
        if not key:
            raise errors.Unauthenticated("malformed authorization metadata: expected 'Bearer <key>'")
        principal = self._auth.authenticate(key)
        if principal is None:
            raise errors.Unauthenticated("unknown or revoked API key")
        role = "admin" if plane == "admin" else "tenant"
        if principal.kind != role:
            if role == "admin":
                raise errors.PermissionDenied(f"{method} needs an admin key; this key belongs to a tenant")
            raise errors.PermissionDenied(f"{method} needs a tenant's API key; admin keys cannot decode")
        return principal

    def _refusal(self, handler: grpc.RpcMethodHandler, labels: tuple[str, str, str], method: str,
                 exc: errors.ServiceError) -> grpc.RpcMethodHandler:
        """A handler that answers ``exc`` at once, without waiting for the request message."""
        if isinstance(exc, (errors.Unauthenticated, errors.PermissionDenied)):
            self.capacity.unauthenticated.hit(f"{method}: {exc.message}")
        code, message, trailers = _classify(exc, method)
        metrics = self._metrics

        async def refuse(requests, context):
            metrics.observe_rpc_started(*labels)
            metrics.observe_rpc(*labels, code.name, 0.0)
            await context.abort(code, message, trailers)

        return _as_stream_handler(handler, refuse)

    def _wrap(self, handler: grpc.RpcMethodHandler, labels: tuple[str, str, str], full: str, plane: str,
              principal: Principal | None) -> grpc.RpcMethodHandler:
        metrics = self._metrics
        capacity = self.capacity
        parse = _parser(handler.request_deserializer, full)
        request_streaming = handler.request_streaming
        public_stream = plane == "public" and handler.response_streaming

        async def enter(requests, context, held: list[Callable[[], None]]) -> Any:
            """The call's request (a stream of them for a streaming RPC), once its first message is in
            and the call holds its places; what to release goes into ``held``."""
            try:
                first = await capacity.pending.first_message(context.peer(), requests)
            except StopAsyncIteration:
                if not request_streaming:
                    raise errors.InvalidArgument(f"no request message was sent to {full}") from None
                first = _EMPTY
            capacity.planes.acquire(plane)
            held.append(lambda: capacity.planes.release(plane))
            if public_stream:
                peer = context.peer()
                capacity.public_streams.acquire(peer)
                held.append(lambda: capacity.public_streams.release(peer))
            if principal is not None:
                _principal.set(principal)
            if not request_streaming:
                return parse(first)
            return _request_stream(first, requests, parse)

        def accounted(context: Any) -> contextlib.AbstractAsyncContextManager[list[Callable[[], None]]]:
            return _accounted(metrics, labels, full, context)

        if handler.response_streaming:
            inner = handler.unary_stream or handler.stream_stream

            async def streaming(requests, context):
                async with accounted(context) as held:
                    result = inner(await enter(requests, context, held), context)
                    if inspect.isasyncgen(result):
                        async with contextlib.aclosing(result):
                            async for response in result:
                                yield response
                    else:
                        await result

            return _as_stream_handler(handler, streaming)

        inner = handler.unary_unary or handler.stream_unary

        async def unary(requests, context):
            async with accounted(context) as held:
                result = inner(await enter(requests, context, held), context)
                return await result if inspect.isawaitable(result) else result

        return _as_stream_handler(handler, unary)


@contextlib.asynccontextmanager
async def _accounted(metrics: Any, labels: tuple[str, str, str], full: str,
                     context: Any) -> AsyncIterator[list[Callable[[], None]]]:
    """Around one call: its metrics, its status for whatever it raised, and its places (what the body
    appends to the list it gets) released at the end."""
    start = time.perf_counter()
    metrics.observe_rpc_started(*labels)
    held: list[Callable[[], None]] = []
    code = grpc.StatusCode.OK
    try:
        yield held
    except grpc.aio.AbortError:
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    except BaseException as exc:
        if _is_cancel(exc):
            code = _cancelled_code(context)
            raise
        code, message, trailers = _classify(exc, full)
        await context.abort(code, message, trailers)
    finally:
        for release in reversed(held):
            release()
        metrics.observe_rpc(*labels, code.name, time.perf_counter() - start)


def _cancelled_code(context: Any) -> grpc.StatusCode:
    """DEADLINE_EXCEEDED for a call whose deadline passed, else CANCELLED (the client went away)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def _as_stream_handler(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """``behavior`` as a handler that takes its requests as a stream (so grpc starts it at once, before
    any message) with ``handler``'s response shape. Requests arrive as bytes and are parsed in the
    wrapper, so that a malformed message gets INVALID_ARGUMENT (grpc's own deserializer failure would
    read as INTERNAL)."""
    factory = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
        grpc.stream_unary_rpc_method_handler
    return factory(behavior, request_deserializer=None, response_serializer=handler.response_serializer)


async def _request_stream(first: Any, rest: Any, parse: Callable[[Any], Any]) -> AsyncIterator[Any]:
    if first is _EMPTY:
        return
    yield parse(first)
    async for raw in rest:
        yield parse(raw)


def _parser(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[Any], Any]:
    if deserializer is None:
        return lambda raw: raw

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:  # noqa: BLE001 - DecodeError and friends
            raise errors.InvalidArgument(f"malformed request: cannot parse the message sent to {method}") from None

    return parse


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.CancelledError, GeneratorExit))


def _classify(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    if isinstance(exc, MessageTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), ()
    if isinstance(exc, errors.ServiceError):
        return status_code(exc), exc.message, _status_trailers(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    log.exception("internal error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log", ()
