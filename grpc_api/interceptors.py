"""One server interceptor: authentication, the error-to-status mapping, and RPC metrics.

Every handler's behaviour is wrapped (keeping its request deserializer and response serializer, so the
wrapper always matches the RPC's shape). The wrapper

1. authenticates ``authorization: Bearer <key>`` and checks the role the service needs: DecodingService
   wants a tenant key, AdminService an admin key; health checking and reflection need none;
2. exposes the principal to the servicer through ``current_principal()``;
3. turns exceptions into statuses in one place: ``serving.errors`` -> its code (``grpc_api.status``; RESOURCE_EXHAUSTED
   with google.rpc.RetryInfo), ``ValueError`` -> INVALID_ARGUMENT, anything else -> INTERNAL with a
   generic message (the traceback goes to the server log only);
4. counts ``grpc_server_started_total``, ``grpc_server_handled_total{grpc_code}`` and
   ``grpc_server_handling_seconds``;
5. holds each anonymous stream (``Health.Watch``, reflection) to ``PublicStreams``' caps, per connection
   and in total: beyond them the stream is refused with RESOURCE_EXHAUSTED and a retry delay, and the
   capacity authenticated calls need is never theirs to take.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

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


class PublicStreams:
    """Caps on the streams anyone may open without a key, in total and per connection (the peer
    address with its port: one HTTP/2 connection). Runs on the event loop."""

    def __init__(self, max_total: int, max_per_connection: int) -> None:
        self.max_total = max_total
        self.max_per_connection = max_per_connection
        self._by_peer: dict[str, int] = {}
        self._total = 0
        self.refused = 0

    @property
    def num_open(self) -> int:
        return self._total

    def acquire(self, peer: str) -> None:
        mine = self._by_peer.get(peer, 0)
        if mine >= self.max_per_connection or self._total >= self.max_total:
            self.refused += 1
            limit = (f"{self.max_per_connection} per connection" if mine >= self.max_per_connection
                     else f"{self.max_total} in all")
            raise errors.ResourceExhausted(f"too many open health-watch or reflection streams ({limit})",
                                           retry_after_s=5.0)
        self._by_peer[peer] = mine + 1
        self._total += 1

    def release(self, peer: str) -> None:
        mine = self._by_peer.get(peer, 0) - 1
        if mine > 0:
            self._by_peer[peer] = mine
        else:
            self._by_peer.pop(peer, None)
        self._total -= 1


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Authentication, error mapping, metrics and the anonymous streams' caps for every RPC (see the
    module docstring)."""

    def __init__(self, authenticator: Authenticator, metrics: Any = None,
                 public_streams: PublicStreams | None = None) -> None:
        self._auth = authenticator
        self._metrics = metrics if metrics is not None else NullMetrics()
        self._public = public_streams if public_streams is not None else PublicStreams(64, 4)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        full = handler_call_details.method  # "/package.Service/Method"
        service, _, method = full.strip("/").rpartition("/")
        if service.startswith(PUBLIC_PREFIXES):
            role = None
        elif service == ADMIN_PLANE:
            role = "admin"
        else:
            role = "tenant"
        rpc_type = _rpc_type(handler)
        labels = (service, method, rpc_type)
        check = self._check_factory(role, full)
        metrics = self._metrics
        parse = _parser(handler.request_deserializer, full)
        if handler.request_streaming:
            def prepare(raw):
                async def parsed():
                    async for item in raw:
                        yield parse(item)
                return parsed()
        else:
            prepare = parse

        async def finish(context, code: grpc.StatusCode, start: float) -> None:
            metrics.observe_rpc(*labels, code.name, time.perf_counter() - start)

        async def fail(context, exc: BaseException, start: float):
            code, message, trailers = _classify(exc, full)
            await finish(context, code, start)
            await context.abort(code, message, trailers)

        def cancelled_code(context) -> grpc.StatusCode:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                return grpc.StatusCode.DEADLINE_EXCEEDED
            return grpc.StatusCode.CANCELLED

        if handler.response_streaming:
            inner = handler.unary_stream or handler.stream_stream

            public = self._public if role is None else None

            async def streaming(request_or_iterator, context):
                start = time.perf_counter()
                metrics.observe_rpc_started(*labels)
                peer = None
                try:
                    check(context)
                    if public is not None:
                        public.acquire(context.peer())
                        peer = context.peer()
                    result = inner(prepare(request_or_iterator), context)
                    if inspect.isasyncgen(result):
                        async with contextlib.aclosing(result):
                            async for response in result:
                                yield response
                    else:
                        await result
                except grpc.aio.AbortError:
                    await finish(context, context.code() or grpc.StatusCode.UNKNOWN, start)
                    raise
                except BaseException as exc:
                    if _is_cancel(exc):
                        await finish(context, cancelled_code(context), start)
                        raise
                    await fail(context, exc, start)
                else:
                    await finish(context, grpc.StatusCode.OK, start)
                finally:
                    if peer is not None and public is not None:
                        public.release(peer)

            behavior = streaming
        else:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request_or_iterator, context):
                start = time.perf_counter()
                metrics.observe_rpc_started(*labels)
                try:
                    check(context)
                    result = inner(prepare(request_or_iterator), context)
                    if inspect.isawaitable(result):
                        result = await result
                except grpc.aio.AbortError:
                    await finish(context, context.code() or grpc.StatusCode.UNKNOWN, start)
                    raise
                except BaseException as exc:
                    if _is_cancel(exc):
                        await finish(context, cancelled_code(context), start)
                        raise
                    await fail(context, exc, start)
                await finish(context, grpc.StatusCode.OK, start)
                return result

            behavior = unary

        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        # Requests arrive as bytes and are parsed in the wrapper, so that a malformed message gets
        # INVALID_ARGUMENT (grpc's own deserializer failure would read as INTERNAL).
        return factory(behavior, request_deserializer=None, response_serializer=handler.response_serializer)

    def _check_factory(self, role: str | None, method: str) -> Callable[[Any], None]:
        auth = self._auth

        def check(context) -> None:
            if role is None:
                return
            key = bearer_key(context.invocation_metadata())
            if key is None:
                raise errors.Unauthenticated(
                    "missing credentials: send metadata 'authorization: Bearer <key>'")
            if not key:
                raise errors.Unauthenticated("malformed authorization metadata: expected 'Bearer <key>'")
            principal = auth.authenticate(key)
            if principal is None:
                raise errors.Unauthenticated("unknown or revoked API key")
            if principal.kind != role:
                if role == "admin":
                    raise errors.PermissionDenied(f"{method} needs an admin key; this key belongs to a tenant")
                raise errors.PermissionDenied(f"{method} needs a tenant's API key; admin keys cannot decode")
            _principal.set(principal)

        return check


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
    if isinstance(exc, errors.ServiceError):
        return status_code(exc), exc.message, _status_trailers(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    log.exception("internal error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log", ()
