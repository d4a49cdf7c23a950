"""The model runner: requests in slots of a preallocated KV cache, whole draft trees verified in one pass.

    runner = ModelRunner(model, num_slots=4, max_len=4096)
    slot = runner.start(prompt_ids, SamplingParams())      # prefill prompt[:-1]; prompt[-1] is the root
    [result] = runner.verify([VerifyStep(slot, tree)])     # one forward over root + tree, accept, compact
    result.token_ids                                       # accepted draft tokens, then the bonus token
    runner.release(slot)

Several requests verify together in one forward pass, padded to the same number of rows (verifier/tree.py).
After acceptance the cache is compacted to the accepted path, so it equals a fresh prefill of the
committed tokens. Not thread-safe: one engine thread owns a runner.

With ``prefix_cache_bytes`` the runner keeps finished requests' KV (verifier/prefix_cache.py):
``start(..., cache_scope=tenant)`` copies the longest cached prefix of the scope into the new slot and
prefills only the rest; ``release`` caches the slot's committed rows for later requests of that scope.

A running request can give its slot up and take another later (``park`` / ``resume``: the engine's
fair share of slots between tenants): its committed rows go to the prefix cache like a finished
request's, and resuming loads what is still cached and prefills the rest, so it goes on from the
same context with the same sampling generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrieval.draft_tree import DraftTree
from verifier import acceptance
from verifier.attention import META_KWARG, TreeAttentionMeta, register
from verifier.kernels import compact_kv, triton_available
from verifier.kv_cache import KVPool, StepCache
from verifier.lean_model import LeanForward, lean_forward_of, supports_lean
from verifier.models import cache_keyword, check_supported
from verifier.prefix_cache import DEFAULT_BLOCK_SIZE, Lease, PrefixCache
from verifier.sampling import (
    RowContext,
    SamplingParams,
    apply_processors,
    apply_token_mask,
    sample_rows,
    warp_probs,
)
from verifier.tree import StepBatch, additive_mask, chain_batch, check_additive_mask, layout_tree, pack_steps

BACKENDS = ("auto", "triton", "torch", "model")
FORWARDS = ("auto", "lean", "transformers")


@dataclass(frozen=True, slots=True)
class VerifyStep:
    """One request's input to a verification pass.

    ``q`` [T, V] is given only for drafts *sampled* from known draft distributions (row i: the
    distribution node i was drawn from); without it the tree is treated as deterministic (q one-hot).
    ``q_mode``: ``iid`` (SpecInfer) or ``without_replacement`` (Sequoia); see verifier/acceptance.py.
    ``token_mask`` [1+T, ceil(V/32)] int32: the tokens each row may produce (a grammar's; bit j of word w
    allows token 32w+j); the others are masked out of that row's logits before acceptance.
    """

    slot: int
    tree: DraftTree
    q: torch.Tensor | None = None
    q_mode: str = "iid"
    token_mask: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What one request committed in a step.

    ``accepted``: draft node indices of the accepted path, root to leaf. ``token_ids``: their tokens,
    then the bonus token (always at least one token). ``hidden_states`` [len(token_ids), d]: the target's
    top hidden state at the rows that produced ``token_ids`` (root, then accepted nodes), for neural
    drafters; None unless the runner keeps them.
    """

    slot: int
    accepted: np.ndarray  # [n] int32
    token_ids: np.ndarray  # [n + 1] int32
    num_drafted: int
    hidden_states: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ParkedRequest:
    """A request that gave up its slot (``ModelRunner.park``), with what resuming it needs: its context
    (prompt + committed output; the last token is the next step's root), how much of it is prompt, its
    sampling settings and its generator's state (a seeded request draws the same numbers after it
    resumes), its minimum length and the tokens held back until then, its prefix-cache scope, and the
    prompt tokens it first found cached."""

    context: tuple[int, ...]
    num_prompt: int
    sampling: SamplingParams
    generator_state: torch.Tensor
    min_new_tokens: int
    suppress_ids: tuple[int, ...]
    scope: str | None
    num_reused: int


@dataclass(slots=True)
class _Slot:
    """Mutable state of one active request (internal)."""

    context: list[int]  # prompt + committed output; the last one is the root (its KV is not cached yet)
    num_prompt: int
    sampling: SamplingParams
    generator: torch.Generator
    min_new_tokens: int
    suppress_ids: tuple[int, ...]
    prompt_hidden: torch.Tensor | None = None  # [P-1, d] when the runner keeps hidden states
    scope: str | None = None  # the prefix cache's scope (the tenant), None to use no cache
    lease: Lease | None = None  # the cached blocks the request started from (with a prefix cache)
    num_reused: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def cached(self) -> int:
        return len(self.context) - 1


class ModelRunner:
    """Runs a transformers causal LM over a slotted KV cache.

    ``max_len`` bounds prompt + output tokens per request; ``max_draft_nodes`` bounds a step's tree.
    ``backend``: ``auto`` (Triton kernels on CUDA, torch references on CPU), ``triton``, ``torch``, or
    ``model`` (the model's own attention with a float additive mask; torch compaction).
    ``keep_hidden`` returns top hidden states in every :class:`VerifyResult` (off: costs nothing).
    ``prefix_cache_bytes`` > 0 keeps finished requests' KV in a tenant-scoped prefix cache of that size
    (blocks of ``prefix_block_size`` tokens). A runner that keeps hidden states does not use it: neural
    drafters read the hidden state of every prompt row, which the cache does not hold.
    """

    def __init__(
        self,
        model: Any,
        *,
        num_slots: int = 1,
        max_len: int = 4096,
        max_draft_nodes: int = 64,
        backend: str = "auto",
        keep_hidden: bool = False,
        prefill_chunk: int = 2048,  # a typical agent prompt in one causal chunk (faster than in 512s: docs/verifier.md)
        prefix_cache_bytes: int = 0,
        prefix_block_size: int = DEFAULT_BLOCK_SIZE,
        forward: str = "auto",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        if max_draft_nodes < 0:
            raise ValueError(f"max_draft_nodes must be >= 0, got {max_draft_nodes}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
        if forward not in FORWARDS:
            raise ValueError(f"unknown forward {forward!r}; use one of {FORWARDS}")
        check_supported(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" and triton_available() else "torch"
        self.backend = backend
        self.model = model.eval()
        if backend != "model":
            self.model.set_attn_implementation(register())
        self._base = model.base_model
        self._lm_head = model.get_output_embeddings()
        self._cache_kw = cache_keyword(self._base)
        if forward == "lean" and (backend != "torch" or not supports_lean(model)):
            raise ValueError(
                f"forward='lean' needs the torch backend and a Llama or Qwen2 model with plain RoPE "
                f"(backend {backend!r}, model type {getattr(model.config, 'model_type', None)!r})"
            )
        lean = forward == "lean" or (forward == "auto" and backend == "torch" and supports_lean(model))
        self._lean: LeanForward | None = lean_forward_of(model) if lean else None
        self.forward_kind = "lean" if lean else "transformers"
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size: int = text.vocab_size
        self.max_len = max_len
        self.max_draft_nodes = max_draft_nodes
        self.keep_hidden = keep_hidden
        self.prefill_chunk = prefill_chunk
        self.pool = KVPool(
            model.config, num_slots=num_slots, max_rows=max_len + max_draft_nodes + 1, dtype=self.dtype,
            device=self.device,
        )  # fmt: skip
        pool = self.pool
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(
                num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, dtype=self.dtype,
                device=self.device, capacity_bytes=prefix_cache_bytes, block_size=prefix_block_size,
            )
            if prefix_cache_bytes > 0
            else None
        )  # fmt: skip
        self._placeholder_mask = torch.zeros((1, 1, 1, 1), dtype=self.dtype, device=self.device)
        self._slots: dict[int, _Slot] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    # ---- request lifecycle ------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def context_ids(self, slot: int) -> list[int]:
        """Prompt + committed output of an active request (a copy)."""
        return list(self._state(slot).context)

    def remaining(self, slot: int) -> int:
        """How many more tokens the request may commit before reaching ``max_len``."""
        return self.max_len - len(self._state(slot).context)

    def start(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        min_new_tokens: int = 0,
        suppress_ids: Sequence[int] = (),
        cache_scope: str | None = None,
        publish: bool = False,
    ) -> int:
        """Take a free slot and prefill the prompt (all but its last token, the first step's root).

        ``cache_scope`` (a tenant): start from the longest prefix of the prompt that the prefix cache
        holds for that scope and prefill only the rest; ``num_reused(slot)`` says how many tokens that
        saved. None, a runner without a prefix cache, or one that keeps hidden states prefill it all.
        ``publish``: cache the prompt's blocks as soon as it is prefilled (``PrefixCache.publish``), so
        that requests of the scope starting while this one runs reuse it; only for a request whose KV
        may be kept (``release(keep_cache=True)`` is what it would get at its end)."""
        sampling = sampling or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; this runner's max_len is {self.max_len}")
        generator = torch.Generator(device=self.device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        state = _Slot(prompt, len(prompt), sampling, generator, min_new_tokens, tuple(suppress_ids), scope=cache_scope)
        return self._open(state, publish=publish, counted=True)

    def park(self, slot: int, *, keep_cache: bool = True) -> ParkedRequest:
        """Free a running request's slot, keeping what ``resume`` needs. With a prefix cache and
        ``keep_cache`` its committed rows are cached first, as ``release`` caches a finished request's
        (pass ``keep_cache=False`` for a request whose KV may not be kept: it is recomputed on resume)."""
        state = self._state(slot)
        parked = ParkedRequest(tuple(state.context), state.num_prompt, state.sampling, state.generator.get_state(),
                               state.min_new_tokens, state.suppress_ids, state.scope, state.num_reused)
        self.release(slot, keep_cache=keep_cache)
        return parked

    def resume(self, parked: ParkedRequest) -> int:
        """A parked request back in a free slot: its context's KV loaded from the prefix cache where its
        blocks are still there and prefilled where not (prefill computes the rows a step would, as a
        request starting from cached KV does), its generator where it was. Returns the slot."""
        generator = torch.Generator(device=self.device)
        generator.set_state(parked.generator_state)
        state = _Slot(list(parked.context), parked.num_prompt, parked.sampling, generator, parked.min_new_tokens,
                      parked.suppress_ids, scope=parked.scope)
        slot = self._open(state, publish=False, counted=False)
        state.num_reused, state.prompt_hidden = parked.num_reused, None  # its session saw the prompt's states
        return slot

    def _open(self, state: _Slot, *, publish: bool, counted: bool) -> int:
        """Take a free slot for ``state`` and fill its KV with ``state.context[:-1]``: what the prefix
        cache holds of the scope (a lookup ``counted`` in the hit rate or not), prefilled past it."""
        if not self._free:
            raise RuntimeError(f"no free slot: all {self.pool.num_slots} are in use")
        slot = self._free.pop()
        self._slots[slot] = state
        context = state.context
        try:
            with torch.inference_mode():
                if state.scope is not None and self.prefix_cache is not None and not self.keep_hidden:
                    # The root's KV is computed by the first step, so at most context[:-1] is reused.
                    state.lease = self.prefix_cache.match(state.scope, context[:-1],
                                                          count=len(context) if counted else 0)
                    state.num_reused = self.prefix_cache.load(state.lease, self.pool.kv, slot)
                    self.pool.mark_written(slot, state.num_reused)
                chunks = []
                for start in range(state.num_reused, len(context) - 1, self.prefill_chunk):
                    chunk = context[start : min(start + self.prefill_chunk, len(context) - 1)]
                    hidden = self._forward([slot], chain_batch(chunk, start))
                    if self.keep_hidden:
                        chunks.append(hidden[0])
                if publish and state.lease is not None and self.prefix_cache is not None and len(context) - 1 > state.num_reused:
                    # Its prompt is reusable now, by requests that start while this one runs.
                    state.lease = self.prefix_cache.publish(state.lease, context[:-1], self.pool.kv, slot)
                if self.keep_hidden:
                    width = self._lm_head.in_features
                    state.prompt_hidden = torch.cat(chunks) if chunks else torch.zeros(0, width, device=self.device)
        except BaseException:
            self.release(slot, keep_cache=False)
            raise
        return slot

    def take_prompt_hidden(self, slot: int) -> torch.Tensor | None:
        """The top hidden states ``[P-1, d]`` of the prompt's prefill (rows of ``prompt[:-1]``), once: the
        runner drops them when taken. None unless the runner keeps hidden states."""
        state = self._state(slot)
        hidden, state.prompt_hidden = state.prompt_hidden, None
        return hidden

    def num_reused(self, slot: int) -> int:
        """Prompt tokens of an active request whose KV came from the prefix cache."""
        return self._state(slot).num_reused

    def release(self, slot: int, *, keep_cache: bool = True) -> None:
        """Free a request's slot at once (its rows are simply overwritten by the next user). With a
        prefix cache and ``keep_cache``, the committed rows (context but the root) are cached first;
        pass ``keep_cache=False`` for a request whose step failed (its rows may be half written)."""
        state = self._slots.pop(slot, None)
        if state is None:
            return
        try:
            if state.lease is not None and self.prefix_cache is not None:
                if keep_cache:
                    self.prefix_cache.insert(state.lease, state.context[:-1], self.pool.kv, slot)
                else:
                    self.prefix_cache.release(state.lease)
        finally:
            self._free.append(slot)

    # ---- one verification pass --------------------------------------------------------------------
    def verify(self, steps: Sequence[VerifyStep]) -> list[VerifyResult]:
        """Verify every request's tree in one forward pass, accept, and compact each cache."""
        if not steps:
            return []
        states = [self._state(s.slot) for s in steps]
        if len({s.slot for s in steps}) != len(steps):
            raise ValueError("a slot appears twice in one verify call")
        layouts = [layout_tree(s.tree) for s in steps]
        for s, st, lay in zip(steps, states, layouts):
            if lay.num_nodes > self.max_draft_nodes:
                raise ValueError(
                    f"slot {s.slot}: tree has {lay.num_nodes} nodes, max_draft_nodes is {self.max_draft_nodes}"
                )
            if len(st.context) + lay.num_rows > self.max_len:
                raise ValueError(
                    f"slot {s.slot}: {len(st.context)} tokens + {lay.num_rows} step rows exceed max_len {self.max_len}"
                )
            if lay.num_nodes and int(lay.token_ids.max()) >= self.vocab_size:
                raise ValueError(
                    f"slot {s.slot}: draft token id {int(lay.token_ids.max())} is outside the vocabulary"
                )
        slots = [s.slot for s in steps]
        batch = pack_steps(layouts, [st.context[-1] for st in states], [st.cached for st in states])
        with torch.inference_mode():
            hidden = self._forward(slots, batch)  # [B, Q, d]
            logits = self._logits(hidden)  # [B, Q, V]
            picks = self._accept(steps, states, layouts, logits)
            results = self._commit(steps, states, layouts, picks, hidden)
        return results

    def score(self, steps: Sequence[VerifyStep]) -> list[torch.Tensor]:
        """Raw target logits ``[1+T, V]`` at the root and every node of each tree, in one forward pass,
        committing nothing (the rows written past each cache's end are overwritten by the next step)."""
        if not steps:
            return []
        states = [self._state(s.slot) for s in steps]
        layouts = [layout_tree(s.tree) for s in steps]
        batch = pack_steps(layouts, [st.context[-1] for st in states], [st.cached for st in states])
        with torch.inference_mode():
            logits = self._logits(self._forward([s.slot for s in steps], batch))
        return [logits[b, : lay.num_rows] for b, lay in enumerate(layouts)]

    def _accept(self, steps, states, layouts, logits) -> list[tuple[np.ndarray, int]]:
        plain = [
            st.sampling.greedy and st.sampling.repetition_penalty == 1.0 and not self._suppressing(st)
            and step.token_mask is None
            for step, st in zip(steps, states)
        ]
        argmax = (
            logits.argmax(dim=-1).cpu().numpy() if any(plain) else np.zeros((0, 0), np.int64)
        )  # [B, Q], one sync
        picks = []
        for b, (step, st, lay) in enumerate(zip(steps, states, layouts)):
            if plain[b]:
                picks.append(acceptance.accept_by_targets(lay, argmax[b, : lay.num_rows]))
                continue
            ctx = RowContext(
                np.asarray(st.context), len(st.context) - st.num_prompt, st.min_new_tokens, st.suppress_ids
            )
            rows = apply_processors(logits[b, : lay.num_rows].clone(), st.sampling, ctx, lay)
            if step.token_mask is not None:
                rows = apply_token_mask(rows, step.token_mask)
            if st.sampling.greedy:
                picks.append(acceptance.accept_by_targets(lay, rows.argmax(dim=-1).cpu().numpy()))
                continue
            probs = warp_probs(rows, st.sampling)
            if step.q is None:
                targets = sample_rows(probs, st.generator).cpu().numpy()
                picks.append(acceptance.accept_by_targets(lay, targets))
            else:
                q = torch.as_tensor(step.q, device=probs.device)
                if q.shape != (lay.num_nodes, probs.shape[-1]):
                    raise ValueError(
                        f"slot {step.slot}: q has shape {tuple(q.shape)}, expected ({lay.num_nodes}, {probs.shape[-1]})"
                    )
                picks.append(acceptance.accept_with_q(lay, probs, q, st.generator, step.q_mode))
        return picks

    def _commit(self, steps, states, layouts, picks, hidden) -> list[VerifyResult]:
        moves = []  # (slot, base, kept rows) for caches whose accepted rows are not already in place
        results = []
        for b, (step, st, lay, (path, bonus)) in enumerate(zip(steps, states, layouts, picks)):
            kept = np.concatenate(([0], path + 1))  # root row, then the accepted nodes' rows
            if not np.array_equal(path, np.arange(len(path))):
                moves.append((step.slot, st.cached, kept))
            token_ids = np.append(lay.token_ids[path], bonus).astype(np.int32)
            kept_hidden = hidden[b, torch.as_tensor(kept, device=hidden.device)] if self.keep_hidden else None
            results.append(VerifyResult(step.slot, path, token_ids, lay.num_nodes, kept_hidden))
            st.context.extend(token_ids.tolist())
        if moves:
            width = max(len(m[2]) for m in moves)
            src = np.zeros((len(moves), width), dtype=np.int64)
            for i, (_, _, kept) in enumerate(moves):
                src[i, : len(kept)] = kept
            compact_kv(
                self.pool.kv, [m[0] for m in moves], [m[1] for m in moves], torch.from_numpy(src),
                [len(m[2]) for m in moves], backend="triton" if self.backend == "triton" else "torch",
            )  # fmt: skip
        return results

    # ---- internals --------------------------------------------------------------------------------
    def _state(self, slot: int) -> _Slot:
        try:
            return self._slots[slot]
        except KeyError:
            raise ValueError(f"slot {slot} is not an active request") from None

    @staticmethod
    def _suppressing(st: _Slot) -> bool:
        return bool(st.suppress_ids) and len(st.context) - st.num_prompt < st.min_new_tokens

    def _forward(self, slots: list[int], batch: StepBatch) -> torch.Tensor:
        """One forward of the base model over the batch's rows; writes their KV; returns ``[B, Q, d]``."""
        dev = self.device
        self.pool.ensure_finite(slots, batch.kv_len)
        if self._lean is not None:
            return self._lean_forward(slots, batch)
        cache = StepCache(
            self.pool,
            torch.tensor(slots, device=dev),
            torch.from_numpy(batch.write_positions).to(dev),
            batch.kv_len,
        )
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self.backend == "model":
            mask = additive_mask(batch.prefix_lens, batch.tree_mask, batch.kv_len, self.dtype).to(dev)
            check_additive_mask(mask)
            kwargs["attention_mask"] = mask
        else:
            kwargs["attention_mask"] = self._placeholder_mask  # 4D: transformers builds no mask of its own
            mask = (
                additive_mask(batch.prefix_lens, batch.tree_mask, batch.kv_len, self.dtype).to(dev)
                if self.backend == "torch" and not batch.causal
                else None
            )  # one mask for every layer
            kwargs[META_KWARG] = TreeAttentionMeta(
                torch.from_numpy(batch.prefix_lens).to(dev, torch.int32), torch.from_numpy(batch.tree_mask).to(dev),
                self.backend, mask, batch.causal,
            )  # fmt: skip
        out = self._base(
            input_ids=torch.from_numpy(batch.input_ids).to(dev),
            position_ids=torch.from_numpy(batch.position_ids).to(dev),
            **kwargs,
        )
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[B, Q, V]`` of top hidden states ``[B, Q, d]``."""
        head = self._lean.lm_head if self._lean is not None else self._lm_head
        return head(hidden).float()

    def _lean_forward(self, slots: list[int], batch: StepBatch) -> torch.Tensor:
        """The lean forward (verifier/lean_model.py): no mask when every row sees all of its request's
        rows (a plain step of one request, or of requests at the same length), SDPA's causal kernel for
        a chain from position 0, the additive tree mask otherwise."""
        assert self._lean is not None
        dev = self.device
        num_rows = batch.num_rows
        prefix = batch.prefix_lens
        unmasked = num_rows == 1 and bool((prefix == prefix[0]).all())
        mask = None
        if not batch.causal and not unmasked:
            mask = additive_mask(prefix, batch.tree_mask, batch.kv_len, self.dtype).to(dev)
        return self._lean(
            self.pool.kv, slots, torch.from_numpy(batch.input_ids).to(dev),
            torch.from_numpy(batch.position_ids).to(dev), [int(p) for p in prefix], batch.kv_len, mask,
            batch.causal,
        )  # fmt: skip
