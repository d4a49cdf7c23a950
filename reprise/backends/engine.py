"""The decode backend over Reprise's own engine: ``reprise.engine.Engine`` stepping on its own thread.

Implements ``grpc_api.backend.DecodeBackend``, the seam both fronts (gRPC, HTTP) talk to. The engine
thread runs ``Engine.serve``: every step packs all active requests into one verification pass. A front's
worker thread submits its request and waits on the handle; committed tokens reach the caller through
the engine's stream callback as they are committed; the request returns once its turn is in the
history store (``reprise.backends.stored``). Cancelling (client gone, deadline, Abort) sets the request's event;
the engine drops it at its next step and frees its KV slot at once.

Chat prompts go through the model's chat template. Tools and an assistant's earlier tool calls are
handed to the template when it renders them (it mentions ``tools`` / ``tool_calls``); otherwise the
model's tool-call format (``grpc_api.tool_calls``) renders them: the tools as a system prompt, the calls
as the text the model writes for them. An ``OutputConstraint`` is compiled into a grammar the engine
decodes under (reprise/engine/grammar.py).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from grpc_api import errors
from grpc_api.backend import (
    ChatMessage,
    GenerateParams,
    Generation,
    ModelInfo,
    PromptInput,
    TokenCallback,
    Tool,
)
from grpc_api.tool_calls import FORMATS, format_for
from reprise.backends.stored import STORE_WAIT_S, await_stored
from reprise.engine.engine import Engine
from reprise.engine.grammar_compiler import GrammarCompiler
from reprise.engine.request import GenerationRequest, StoppingParams
from verifier.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineBackend:
    """``DecodeBackend`` over ``reprise.engine.engine.Engine``.

    ``record_trajectory(tenant, session_id, token_ids)`` stores a turn that did not go through the
    engine (``AppendTrajectory``) durably and adds it to the tenant's drafting history.
    """

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str,
                 record_trajectory: Callable[[str, str, Sequence[int]], None] | None = None,
                 on_close: Callable[[], None] | None = None, store_before_reply: bool = True,
                 store_wait_s: float = STORE_WAIT_S, on_store_wait: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        runner = engine.runner
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        template = template if isinstance(template, str) else ""
        self._info = ModelInfo(
            model_name=model_name, max_context_tokens=runner.max_len, eos_token_ids=tuple(engine.eos_token_ids),
            vocab_size=runner.vocab_size, has_chat_template=bool(template),
            tool_call_format=format_for(model_name, template),
        )
        self._template_tools = "tools" in template  # the template renders the tool list itself
        self._template_calls = "tool_calls" in template  # ... and an assistant's tool calls
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._record = record_trajectory
        self._store_before_reply = store_before_reply
        self._store_wait_s = store_wait_s
        self._on_store_wait = on_store_wait
        self._on_close = on_close
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="reprise-engine", daemon=True)
        self._thread.start()

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
        messages, tools = self._chat(prompt.messages or (), prompt.tools)
        try:
            ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          tokenize=True)
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the caller's
            raise errors.InvalidArgument(f"the chat template rejected these messages: {exc}") from None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _chat(self, messages: tuple[ChatMessage, ...], tools: tuple[Tool, ...]) -> tuple[list[dict], list | None]:
        """Messages (and tools) as the chat template takes them; see the module docstring."""
        fmt = FORMATS[self._info.tool_call_format]
        out: list[dict] = []
        for m in messages:
            d: dict = {"role": m.role, "content": m.content}
            if m.tool_calls and self._template_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                                   for c in m.tool_calls]
            elif m.tool_calls:
                d["content"] = (m.content + "\n" if m.content else "") + fmt.render_calls(m.tool_calls)
            if m.role == "tool":
                d["tool_call_id"] = m.tool_call_id
                if m.name:
                    d["name"] = m.name
            out.append(d)
        if not tools:
            return out, None
        if self._template_tools:
            return out, [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": json.loads(t.parameters or "{}")}}
                         for t in tools]
        system = fmt.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": system + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out, None

    def _grammar(self, params: GenerateParams, tenant: str) -> Any:
        if params.constraint is None:
            return None
        with self._grammar_lock:  # built once, on the first constrained request (xgrammar loads lazily)
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.engine.runner.vocab_size,
                                                 self.engine.eos_token_ids)
        return self._grammars.compile(params.constraint, tenant=tenant, max_tokens=params.max_new_tokens)

    def generate(self, tenant: str, session_id: str, request_id: str, prompt_ids: Sequence[int],
                 params: GenerateParams, on_tokens: TokenCallback, cancel: threading.Event) -> Generation:
        if not self._thread.is_alive():
            raise errors.Unavailable("the decoding engine has stopped")
        if params.constraint is not None and self.tokenizer is None:
            raise errors.FailedPrecondition("structured output needs the model's tokenizer; this server has none")
        request = GenerationRequest(
            prompt_ids=tuple(int(t) for t in prompt_ids),
            sampling=SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    repetition_penalty=params.repetition_penalty, seed=params.seed),
            stopping=StoppingParams(max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
                                    stop_token_ids=params.stop_token_ids, stop_strings=params.stop,
                                    ignore_eos=params.ignore_eos,
                                    include_stop_string=params.include_stop_str_in_output),
            tenant=tenant, session_id=session_id, request_id=request_id, record_history=params.record,
            speculate=params.speculate, grammar=self._grammar(params, tenant),
        )
        handle = self.engine.submit(request, on_stream=lambda ids, text: on_tokens(ids, text), cancel=cancel)
        while not handle.done.wait(0.5):  # wake up now and then: the engine thread may have died
            if not self._thread.is_alive():
                raise errors.Unavailable("the decoding engine stopped while the request ran")
        result = handle.wait()
        if self._store_before_reply:
            await_stored(handle.stored, self._store_wait_s, self._on_store_wait)
        return Generation(result.finish_reason, result.matched_stop, result.usage.prompt_tokens,
                          result.usage.completion_tokens, result.usage.cached_tokens)

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


def _json_or_text(text: str) -> Any:
    """Tool-call arguments as the chat templates expect them: the parsed JSON object (text if it is not)."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text
