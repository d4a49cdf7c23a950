"""One prompt renderer for every engine: chat messages, tools, tool calls and tool results through the
model's chat template, and the model's tool-call format.

    renderer = PromptRenderer(tokenizer, model_name)
    ids = renderer.render(PromptInput(messages=..., tools=...))      # token ids, generation prompt added

Tools and an assistant's earlier tool calls are handed to the template when it renders them (it
mentions ``tools`` / ``tool_calls``); otherwise the model's tool-call format (``serving.tool_calls``)
renders them: the tools as a system prompt, the calls as the text the model writes for them. A tool
message's ``tool_call_id`` and ``name`` reach the template as fields of the message. Both engines get
their prompt ids from here (the serving core renders before the engine sees the request), so a
request reads the same to the model whichever engine decodes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from serving import errors
from serving.records import ChatMessage, ModelInfo, PromptInput, Tool
from serving.tool_calls import FORMATS, format_for


def chat_template(tokenizer: Any) -> str:
    """The tokenizer's chat template text ("" when it has none)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return template if isinstance(template, str) else ""


def max_token_chars(tokenizer: Any, vocab_size: int) -> int:
    """The most characters one token of the vocabulary decodes to (at least 1)."""
    if tokenizer is None:
        return 64
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    except Exception:  # noqa: BLE001 - a tokenizer without the method: a generous bound
        return 64
    # Byte-level BPE writes a byte as one character of its alphabet, so a piece's length is its bytes'.
    return max(1, max((len(p) for p in pieces if isinstance(p, str)), default=1))


def model_info(tokenizer: Any, model_name: str, max_context_tokens: int, eos_token_ids: Sequence[int],
               vocab_size: int) -> ModelInfo:
    """The served model's ``ModelInfo``; what it says of chat and tools comes from the tokenizer."""
    template = chat_template(tokenizer)
    return ModelInfo(model_name=model_name, max_context_tokens=max_context_tokens,
                     eos_token_ids=tuple(int(t) for t in eos_token_ids), vocab_size=vocab_size,
                     has_chat_template=bool(template), tool_call_format=format_for(model_name, template),
                     max_token_chars=max_token_chars(tokenizer, vocab_size))


class PromptRenderer:
    """Prompts into token ids for one model (its tokenizer, chat template and tool-call format)."""

    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        template = chat_template(tokenizer)
        self._template_tools = "tools" in template  # the template renders the tool list itself
        self._template_calls = "tool_calls" in template  # ... and an assistant's tool calls
        self._format = FORMATS[info.tool_call_format]

    def render(self, prompt: PromptInput, add_generation_prompt: bool = True) -> list[int]:
        """*Blocking* (a worker thread): token ids of a text or chat prompt; token ids pass through."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        tok = self.tokenizer
        if tok is None:
            raise errors.FailedPrecondition("the served model has no tokenizer: send token ids")
        if prompt.text is not None:
            return list(tok.encode(prompt.text, add_special_tokens=False))
        messages, tools = self.chat(prompt.messages or (), prompt.tools)
        try:
            ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          tokenize=True)
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the caller's
            raise errors.InvalidArgument(f"the chat template rejected these messages: {exc}", "messages") from None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def chat(self, messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> tuple[list[dict], list | None]:
        """Messages (and tools) as the chat template takes them; see the module docstring."""
        out: list[dict] = []
        for m in messages:
            d: dict = {"role": m.role, "content": m.content}
            if m.tool_calls and self._template_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                                   for c in m.tool_calls]
            elif m.tool_calls:
                d["content"] = (m.content + "\n" if m.content else "") + self._format.render_calls(m.tool_calls)
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
        system = self._format.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": system + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out, None


def _json_or_text(text: str) -> Any:
    """Tool-call arguments as the chat templates expect them: the parsed JSON object (text if it is not)."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text
