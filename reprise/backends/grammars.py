"""Both engines' output grammars: one ``GrammarCompiler`` per served model, built on first use, and its
refusals as the serving core's errors.

A refusal names the field at fault by the request record's names (each front words it as its caller did:
``serving.errors``): ``max_new_tokens`` when the shortest output does not fit, ``tools[i].parameters``
(``serving.prepare.TOOL_PARAM``) when one tool's parameters cannot be used, else the field that asked
for the constraint."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from reprise.engine.grammar_compiler import CheckedGrammar, GrammarCompiler, GrammarError
from serving import errors
from serving.prepare import TOOL_PARAM
from serving.records import Request


class Grammars:
    """The served model's grammar compiler (per-tenant caches inside), created lazily: xgrammar loads in
    seconds and most servers never see a constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._args = (tokenizer, vocab_size, tuple(stop_token_ids))
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, request: Request) -> CheckedGrammar | None:
        """*Blocking.* The request's checked grammar (None without a constraint) or ``InvalidArgument``."""
        constraint = request.params.constraint
        if constraint is None:
            return None
        tokenizer = self._args[0]
        if tokenizer is None:
            raise errors.FailedPrecondition.about(
                constraint.param, "structured output needs the model's tokenizer; this server has none")
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
        max_new_tokens = request.params.max_new_tokens
        assert max_new_tokens is not None, "the serving core sets max_new_tokens before an engine's check"
        try:
            return self._compiler.compile(constraint, tenant=request.tenant, max_tokens=max_new_tokens)
        except GrammarError as exc:
            raise errors.InvalidArgument.about(_param(exc, request, constraint.param), str(exc)) from None
        except ValueError as exc:
            raise errors.InvalidArgument.about(constraint.param, str(exc)) from None


def _param(exc: GrammarError, request: Request, default: str) -> str:
    if exc.kind == "does_not_fit":
        return "max_new_tokens"
    names = [t.name for t in request.prompt.tools]
    if exc.tool is not None and exc.tool in names:
        return TOOL_PARAM.format(i=names.index(exc.tool))
    return default
