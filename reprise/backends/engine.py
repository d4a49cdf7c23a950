"""The data plane's backend: the decode pipeline's ``Engine`` stepping on its own thread.

Implements ``grpc_api.backend.DecodeBackend``. The engine thread runs ``Engine.serve``: every step
packs all active requests into one verification pass. A gRPC worker thread submits its request and
waits on the handle; committed tokens reach the caller through the engine's stream callback as they
are committed. Cancelling (client gone, deadline, Abort) sets the request's event; the engine drops
it at its next step and frees its KV slot at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from grpc_api import errors
from grpc_api.backend import FinishReason, GenerateParams, Generation, ModelInfo, PromptInput, TokenCallback

log = logging.getLogger(__name__)


class EngineBackend:
    """``DecodeBackend`` over ``reprise.engine.engine.Engine`` (whose proposer is a ``MeteredProposer``).

    ``record_trajectory(tenant, session_id, token_ids)`` stores a turn that did not go through the
    engine (``AppendTrajectory``) durably and adds it to the tenant's drafting history.
    """

    def __init__(self, engine: Any, tokenizer: Any, model_name: str,
                 record_trajectory: Callable[[str, str, Sequence[int]], None] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        runner = engine.runner
        self._info = ModelInfo(
            model_name=model_name, max_context_tokens=runner.max_len, eos_token_ids=tuple(engine.eos_token_ids),
            vocab_size=runner.vocab_size,
            has_chat_template=bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)),
        )
        self._record = record_trajectory
        self._on_close = on_close
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="reprise-engine", daemon=True)
        self._thread.start()

    def _disable_speculation(self, request_id: str) -> None:
        disable = getattr(self.engine.proposer, "disable_speculation", None)
        if disable is None:
            raise errors.FailedPrecondition("this server cannot turn speculation off per request")
        disable(request_id)

    def _serve(self) -> None:
        try:
            self.engine.serve(self._stop)
        except BaseException:  # the engine thread must not die silently: requests would hang
            log.exception("the engine thread failed; the service cannot decode")
            raise

    def model_info(self) -> ModelInfo:
        return self._info

    def tokenize(self, prompt: PromptInput, add_generation_prompt: bool = True) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise errors.FailedPrecondition("the served model has no tokenizer: send token ids")
        if prompt.text is not None:
            return list(tok.encode(prompt.text, add_special_tokens=False))
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages or ()]
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the caller's
            raise errors.InvalidArgument(f"the chat template rejected these messages: {exc}") from None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def generate(self, tenant: str, session_id: str, request_id: str, prompt_ids: Sequence[int],
                 params: GenerateParams, on_tokens: TokenCallback, cancel: threading.Event) -> Generation:
        from reprise.engine.request import GenerationRequest, StoppingParams
        from verifier.sampling import SamplingParams

        if not self._thread.is_alive():
            raise errors.Unavailable("the decoding engine has stopped")
        request = GenerationRequest(
            prompt_ids=tuple(int(t) for t in prompt_ids),
            sampling=SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    repetition_penalty=params.repetition_penalty, seed=params.seed),
            stopping=StoppingParams(max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
                                    stop_token_ids=params.stop_token_ids, stop_strings=params.stop,
                                    ignore_eos=params.ignore_eos,
                                    include_stop_string=params.include_stop_str_in_output),
            tenant=tenant, session_id=session_id, request_id=request_id, record_history=params.record,
        )
        if not params.speculate:
            self._disable_speculation(request_id)
        try:
            handle = self.engine.submit(request, on_stream=lambda ids, text: on_tokens(ids, text), cancel=cancel)
            while not handle.done.wait(0.5):  # wake up now and then: the engine thread may have died
                if not self._thread.is_alive():
                    raise errors.Unavailable("the decoding engine stopped while the request ran")
            result = handle.wait()
        finally:
            if not params.speculate:
                getattr(self.engine.proposer, "forget_request", lambda rid: None)(request_id)
        return Generation(self._finish_reason(result, params), result.matched_stop, result.usage.prompt_tokens,
                          result.usage.completion_tokens)

    def _finish_reason(self, result: Any, params: GenerateParams) -> FinishReason:
        if result.finish_reason == "cancelled":
            return "aborted"
        if result.finish_reason == "stop" and isinstance(result.matched_stop, int) \
                and result.matched_stop not in params.stop_token_ids and result.matched_stop in self._info.eos_token_ids:
            return "eos"
        return cast(FinishReason, result.finish_reason)

    def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        if self._record is None:
            raise errors.FailedPrecondition("this server keeps no history")
        self._record(tenant, session_id, token_ids)
        return len(token_ids)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self._on_close is not None:
            self._on_close()
