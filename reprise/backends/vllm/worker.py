"""The service's hands in vLLM's worker process: a worker extension (``worker_extension_cls``).

vLLM mixes this class into its worker class, so every method here can be called from the service with
``collective_rpc("reprise_...", args=...)``; vLLM runs such calls between engine steps on the thread that
steps the model, in order with the requests added before them. That channel carries:

- ``reprise_attach``: start drafting (drafting settings, the tokenizer's vocabulary for canonical
  number matching, the step budget's cost model);
- each tenant's drafting state: ``reprise_load`` (its trajectories from the encrypted store, at start-up
  or a rebuild), ``reprise_record`` (a finished turn), ``reprise_add_corpus``, ``reprise_evict``,
  ``reprise_delete``, ``reprise_set_tenant_config``, and on a replica ``reprise_snapshot`` and
  ``reprise_restore`` (the state a replica seals, and loads from a sealed snapshot);
- figures back to the service: ``reprise_drain_steps`` (per-step draft and accept counts per tenant, and
  each step's share of its cost against its tokens' plain steps), ``reprise_index_stats``,
  ``reprise_health``, ``reprise_step_cost``.

Calls only a benchmark needs live in the benchmark's own extension (``reprise/benchmarks/vllm_worker.py``).

Arguments are plain values (token ids as int32 bytes) so vLLM's serialisation carries them without
pickling. With tensor parallelism every rank runs the same proposer on the same calls; the service
reads figures from the first rank only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from reprise.backends.vllm.tags import StepWire


def _tokens(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int32).copy()


def _chain_wide(config: Any, num_speculative_tokens: int, chain_factor: int) -> Any:
    """``config`` (a ``DraftingConfig``) with room for the tree a chain is taken from: vLLM verifies
    chains of up to ``num_speculative_tokens``, each the best path of a tree ``chain_factor`` times as
    wide (``retrieval.chain``), and the draft budget cuts them to what they pay for. A tenant's
    ``max_draft_tokens``, tuned for the own engine's tree steps, may widen that tree, never narrow it."""
    return dataclasses.replace(config, max_draft_tokens=max(config.max_draft_tokens,
                                                            num_speculative_tokens * chain_factor))


class RepriseWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is vLLM's model runner."""

    model_runner: Any

    def _reprise_proposer(self) -> Any:
        from reprise.backends.vllm.proposer import RepriseVllmProposer

        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, RepriseVllmProposer):
            raise RuntimeError(  # noqa: TRY004 - a misconfigured engine, not a bad argument
                "vLLM's speculative proposer is not Reprise's: start the engine with "
                "speculative_config method 'custom_class' and model "
                "'reprise.backends.vllm.proposer.RepriseVllmProposer'")
        return drafter

    def reprise_attach(self, drafting: dict[str, Any], vocabulary: list[str] | None, chain_factor: int,
                       stall_timeout_s: float, adaptive: bool, first_token: tuple[int, float] | None = None,
                       fallback_head: str | None = None) -> int:
        """Start drafting with these settings; returns the draft length vLLM verifies at most.
        ``first_token`` (top, weight): re-rank each chain's first token by the target's logits
        (``first_token.FirstTokenRerank``); None keeps the drafter's order. ``fallback_head``: a Medusa
        checkpoint whose chains replace retrieval's where those expect little (``fallback``); a
        checkpoint that does not load raises here, before any request."""
        from reprise.backends.vllm.fallback import load_fallback
        from reprise.backends.vllm.first_token import FirstTokenRerank
        from reprise.engine.draft_budget import DraftBudget
        from retrieval.config import DraftingConfig
        from retrieval.proposer import RepriseProposer

        proposer = self._reprise_proposer()
        tenants = RepriseProposer(_chain_wide(DraftingConfig.from_dict(drafting), proposer.num_speculative_tokens,
                                              chain_factor))
        if vocabulary is not None:
            words = list(vocabulary)
            tenants.set_vocabulary(lambda i: words[i] if 0 <= i < len(words) else "", len(words))
        budget = DraftBudget(max_draft_tokens=proposer.num_speculative_tokens, adaptive=adaptive)
        rerank = FirstTokenRerank(int(first_token[0]), float(first_token[1])) if first_token is not None else None
        fallback = load_fallback(fallback_head) if fallback_head else None
        proposer.attach(self.model_runner, tenants, chain_factor=chain_factor, stall_timeout_s=stall_timeout_s,
                        budget=budget, first_token=rerank, fallback=fallback)
        return int(proposer.num_speculative_tokens)

    def reprise_load(self, tenant: str, trajectories: list[tuple[str, bytes, bytes]], first: bool) -> int:
        """Add stored trajectories (session id, prompt ids, output ids) to the tenant's history; ``first``
        starts the tenant afresh (the first batch of a load or rebuild). Returns how many."""
        from retrieval.tenant_history import Trajectory

        tenants = self._reprise_proposer().tenants
        items = (Trajectory(s, _tokens(p), _tokens(o)) for s, p, o in trajectories)
        if first:
            return int(tenants.load_history(tenant, items))
        return int(tenants.history(tenant).load(items))

    def reprise_record(self, tenant: str, session_id: str, prompt: bytes, output: bytes) -> bool:
        """A finished turn joins the tenant's history; False when the tenant was deleted."""
        try:
            self._reprise_proposer().tenants.record(tenant, session_id, _tokens(prompt), _tokens(output))
        except KeyError:
            return False
        return True

    def reprise_add_corpus(self, tenant: str, documents: list[bytes], replace: bool) -> int:
        return int(self._reprise_proposer().tenants.add_corpus(tenant, [_tokens(d) for d in documents], replace))

    def reprise_evict(self, tenant: str) -> None:
        self._reprise_proposer().tenants.evict(tenant)

    def reprise_delete(self, tenant: str) -> None:
        self._reprise_proposer().tenants.delete(tenant)

    def reprise_set_tenant_config(self, tenant: str, drafting: dict[str, Any] | None) -> None:
        from retrieval.config import DraftingConfig

        proposer = self._reprise_proposer()
        config = None
        if drafting is not None:
            config = _chain_wide(DraftingConfig.from_dict(drafting), proposer.num_speculative_tokens,
                                 proposer.chain_factor)
        proposer.tenants.set_tenant_config(tenant, config)

    def reprise_snapshot(self, tenant: str) -> bytes:
        return self._reprise_proposer().tenants.snapshot(tenant)

    def reprise_restore(self, tenant: str, data: bytes) -> str:
        """Replace the tenant's drafting state with a snapshot; "" when done, else why not ("deleted", or
        what is wrong with the bytes): errors cross vLLM's RPC as text."""
        try:
            self._reprise_proposer().tenants.restore(tenant, bytes(data))
        except KeyError:
            return "deleted"
        except ValueError as exc:
            return str(exc) or "not a snapshot"
        return ""

    def reprise_index_stats(self, tenant: str) -> dict[str, int]:
        return {k: int(v) for k, v in dataclasses.asdict(self._reprise_proposer().tenants.index_stats(tenant)).items()}

    def reprise_drain_steps(self) -> list[StepWire]:
        """The step records since the last drain (``tags.StepRecord``)."""
        return self._reprise_proposer().drain_steps()

    def reprise_health(self) -> dict[str, int]:
        return dataclasses.asdict(self._reprise_proposer().health)

    def reprise_step_cost(self) -> dict[str, float]:
        """The step cost the draft budget prices drafts with (``step_cost.StepCostMeter``): steady
        steps seen, and the fitted ``seconds = base + per_request * requests + per_draft * draft tokens
        + drafted * [any draft] + per_context * context tokens`` (absent until fitted; ``context``: the
        mean context of a request in the steps fitted), the proposer's own call per step, and the plain
        step measured from undrafted steps at each batch size where there were enough
        (``plain_measured_s_b{B}``, at their mean context: what the savings estimate prices there), and
        the steps the payoff guard sent no drafts (``rested_steps``)."""
        meter = self._reprise_proposer().step_cost
        fit = meter.fit()
        figures = {"steps": float(meter.num_steps), "propose_s": meter.propose_seconds,
                   "rested_steps": float(meter.payoff.rested_steps)}
        if fit is not None:
            figures |= {"base_s": fit.base, "per_request_s": fit.per_request, "per_draft_s": fit.per_draft,
                        "drafted_s": fit.drafted, "per_context_token_s": fit.per_context, "context": fit.context}
        figures |= {f"plain_measured_s_b{b}": seconds for b, seconds in meter.measured_plain().items()}
        return figures
