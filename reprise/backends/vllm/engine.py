"""vLLM's asynchronous engine (``AsyncLLM``) on its own event-loop thread, driven from blocking callers.

vLLM keeps its own process model: ``AsyncLLM`` in this process (input processing, detokenisation,
output streams) and the engine core with its workers in child processes (scheduler, paged KV cache,
continuous batching; one worker per tensor-parallel rank). Reprise's gRPC servicers call the decode
backend from worker threads, so this class runs the engine's asyncio loop on one thread and hands
coroutines to it (``call``); there is no HTTP hop.

vLLM, torch and transformers are imported lazily (here, when the engine starts): the CLI starts fast
and the service without the ``vllm`` extra never imports them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from reprise.backends.vllm.versions import require_vllm

log = logging.getLogger(__name__)
T = TypeVar("T")

PROPOSER_CLASS = "reprise.backends.vllm.proposer.RepriseVllmProposer"
WORKER_EXTENSION = "reprise.backends.vllm.worker.RepriseWorkerExtension"
# Fair shares of the slots between tenants (scheduler.py), as vLLM's scheduler or its asynchronous one
SCHEDULERS = {False: "reprise.backends.vllm.scheduler.FairShareScheduler",
              True: "reprise.backends.vllm.scheduler.FairShareAsyncScheduler"}


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """How the engine is built. ``speculation``: "reprise" (Reprise's proposer), "ngram", "suffix"
    (vLLM's own drafters, for comparison) or "off"; ``enforce_eager`` skips graph compilation (a faster
    start, slower steps: tests); ``kv_cache_gib`` is the CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``);
    ``worker_extension`` names the class vLLM mixes into its worker (``worker.RepriseWorkerExtension``
    or a subclass of it)."""

    model: str
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    num_speculative_tokens: int = 16
    speculation: str = "reprise"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kv_cache_gib: float = 2.0
    seed: int = 0
    worker_extension: str = WORKER_EXTENSION
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.speculation not in ("reprise", "ngram", "suffix", "off"):
            raise ValueError(f"speculation must be reprise, ngram, suffix or off, got {self.speculation!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    def speculative_config(self) -> dict[str, Any] | None:
        k = self.num_speculative_tokens
        if self.speculation == "reprise":
            return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}
        if self.speculation == "ngram":
            return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        if self.speculation == "suffix":
            return {"method": "suffix", "num_speculative_tokens": k}
        return None


class VllmEngine:
    """An ``AsyncLLM`` and the thread running its loop. ``call`` runs a coroutine there and waits."""

    def __init__(self, settings: VllmSettings) -> None:
        require_vllm()
        self.settings = settings
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{settings.kv_cache_gib:g}")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the CLI's (--json)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="reprise-vllm", daemon=True)
        self._thread.start()
        try:
            self.llm: Any = self.call(self._start())
        except BaseException:
            self._stop_loop()
            raise

    async def _start(self) -> Any:
        """vLLM's engine with its scheduler replaced by the fair-share one (``scheduler.py``), of the kind
        (asynchronous or not) vLLM chose for these settings."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        args = AsyncEngineArgs(
            model=s.model, tokenizer=s.model, dtype=cast(Any, s.dtype), max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs, enable_prefix_caching=True, seed=s.seed,
            tensor_parallel_size=s.tensor_parallel_size, enforce_eager=s.enforce_eager,
            speculative_config=s.speculative_config(),
            worker_extension_cls=s.worker_extension,
            disable_log_stats=True, **s.extra,
        )
        config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        if config.scheduler_config.scheduler_cls is None:  # an operator's own (``extra``) stays
            config.scheduler_config.scheduler_cls = SCHEDULERS[bool(config.scheduler_config.async_scheduling)]
        return AsyncLLM.from_vllm_config(config, disable_log_stats=True)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the engine's loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def rpc(self, method: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        """``collective_rpc(method, args)`` on every worker: one result per rank. RuntimeError when the
        engine has stopped or does not answer within ``timeout`` seconds."""
        if not self.alive:
            raise RuntimeError(f"vLLM's engine has stopped: cannot call {method}")
        try:
            return self.call(self.llm.collective_rpc(method, args=args), timeout)
        except TimeoutError:
            raise RuntimeError(f"vLLM's workers did not answer {method} within {timeout:g} s") from None

    @property
    def alive(self) -> bool:
        return self.llm is not None and self._thread.is_alive() and not getattr(self.llm, "errored", False)

    def close(self) -> None:
        """Shut the engine down (its child processes end) and stop the loop."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:
                log.warning("vLLM's shutdown failed", exc_info=True)
            del llm  # collected now, while the interpreter is whole (its __del__ shuts down again)
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
