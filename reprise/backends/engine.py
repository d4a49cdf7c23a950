"""The decode backend over Reprise's own engine: ``reprise.engine.Engine`` stepping on its own thread.

Implements ``serving.backend.DecodeBackend``, the seam the serving core talks to. The engine thread runs
``Engine.serve``: every step packs all active requests into one verification pass. ``generate`` submits
the serving core's request record itself (the engine derives its own working state from it) with two
callbacks that hand the engine's events to the caller's event loop
(``call_soon_threadsafe``): committed tokens as they commit, the finished turn once it is resolved. No
thread waits on the request; the reply then waits, on the loop, for its turn to be in the history
store (``reprise.backends.stored``). Cancelling (client gone, deadline, Abort) sets the request's
event; the engine drops it at its next step and frees its KV slot at once.

An ``OutputConstraint`` is compiled into a grammar the engine decodes under (reprise/engine/grammar_compiler.py)
in ``check``, on a worker thread, before the request starts, per tenant (one tenant's compilations never
warm another's cache). If the engine thread ever dies, every request it held fails with UNAVAILABLE,
``alive`` turns False (health says NOT_SERVING) and ``on_fatal`` tells the service, which exits non-zero
so an orchestrator replaces the process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from reprise.backends.grammars import Grammars
from reprise.backends.stored import STORE_WAIT_S, wait_stored
from reprise.engine.engine import Engine, RequestHandle
from serving import errors
from serving.admission import CancelEvent
from serving.records import BackendEvent, Finished, ModelInfo, Request, Tokens
from serving.render import model_info

log = logging.getLogger(__name__)


def refuse_unsupported(request: Request) -> None:
    """InvalidArgument for a parameter this engine cannot apply (vLLM applies them: ``model.engine``)."""
    p = request.params
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(p, name):
            raise errors.bad_field(name, "is not supported by this server's engine (model.engine transformers); "
                                         "send 0, or repetition_penalty, or use a server with model.engine vllm")
    if p.logit_bias:
        raise errors.bad_field("logit_bias", "is not supported by this server's engine (model.engine transformers); "
                                             "use a server with model.engine vllm")


def request_error(exc: BaseException) -> BaseException:
    """A request's failure as the caller should see it: the service's own errors as they are, bad input
    as InvalidArgument, anything else as an internal error whose details stay in the log."""
    if isinstance(exc, errors.ServiceError):
        return exc
    if isinstance(exc, ValueError):
        return errors.InvalidArgument(str(exc))
    log.error("the engine failed a request", exc_info=exc)
    return errors.Internal("the engine failed this request; see the server log")


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on ``loop`` from another thread; nothing when the loop is closed (nobody listens)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


class EngineBackend:
    """``DecodeBackend`` over ``reprise.engine.engine.Engine`` (module docstring).

    ``record_trajectory(tenant, session_id, token_ids)`` stores a turn that did not go through the
    engine (``AppendTrajectory``) durably and adds it to the tenant's drafting history (blocking: it
    runs on a worker thread).
    """

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str,
                 record_trajectory: Callable[[str, str, Sequence[int]], None] | None = None,
                 on_close: Callable[[], None] | None = None, store_before_reply: bool = True,
                 store_wait_s: float = STORE_WAIT_S, on_store_wait: Callable[[float], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        runner = engine.runner
        self._info = model_info(tokenizer, model_name, runner.max_len, engine.eos_token_ids, runner.vocab_size)
        self._grammars = Grammars(tokenizer, runner.vocab_size, engine.eos_token_ids)
        self._record = record_trajectory
        self._store_before_reply = store_before_reply
        self._store_wait_s = store_wait_s
        self._on_store_wait = on_store_wait
        self._on_close = on_close
        self._on_fatal = on_fatal
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="reprise-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.engine.serve(self._stop)
        except BaseException as exc:  # the engine thread must not die silently: requests would hang
            log.critical("the engine thread failed; the service cannot decode", exc_info=exc)
            self._failure = exc
            self.engine.fail_all(errors.Unavailable("the decoding engine stopped; retry on another replica"))
            if self._on_fatal is not None:
                self._on_fatal(exc)

    # ---- DecodeBackend -------------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self._info

    @property
    def alive(self) -> bool:
        return self._failure is None and self._thread.is_alive()

    async def check(self, request: Request) -> None:
        refuse_unsupported(request)
        if request.params.constraint is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._grammars.compile, request)

    async def generate(self, request: Request, cancel: CancelEvent) -> AsyncGenerator[BackendEvent, None]:
        if not self.alive:
            raise errors.Unavailable("the decoding engine has stopped; retry on another replica")
        loop = asyncio.get_running_loop()
        grammar = None
        if request.params.constraint is not None:  # compiled by check(): a cache hit
            grammar = await loop.run_in_executor(None, self._grammars.compile, request)
        events: asyncio.Queue[Tokens | RequestHandle] = asyncio.Queue()
        handle = self.engine.submit(
            request, grammar=grammar, cancel=cancel,
            on_stream=lambda ids, text: call_soon(loop, events.put_nowait, Tokens(tuple(ids), text)),
            on_done=lambda h: call_soon(loop, events.put_nowait, h))
        try:
            while True:
                item = await events.get()
                if isinstance(item, Tokens):
                    yield item
                    continue
                break
            if handle.error is not None:
                raise request_error(handle.error)
            result = handle.result
            assert result is not None
            if self._store_before_reply:
                await wait_stored(handle.stored, self._store_wait_s, self._on_store_wait)
            yield Finished(result.finish_reason, result.usage, result.matched_stop, token_ids=result.token_ids)
        finally:
            cancel.set()  # a caller that left early: the engine drops the request at its next step

    async def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        if self._record is None:
            raise errors.FailedPrecondition("this server keeps no history")
        record = self._record
        await asyncio.get_running_loop().run_in_executor(None, record, tenant, session_id, list(token_ids))
        return len(token_ids)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close_now)

    def close_now(self) -> None:
        """*Blocking.* Stop the engine thread and flush history (also where no event loop runs)."""
        self._stop.set()
        self._thread.join(30)
        if self._on_close is not None:
            self._on_close()
