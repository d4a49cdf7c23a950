"""How the service starts on vLLM (``model.engine = "vllm"``): engine, drafting state, backend.

    backend, indexes = start_vllm(config, store, accounting, metrics, history_sink)

Order: the model folder (``model.path``, or the default SmolLM2 converted once to safetensors by
``verifier.models``), the engine (vLLM's processes start and compile: tens of seconds to minutes), the
proposer attached in the worker with the drafting settings and the tokenizer's vocabulary, each tenant's
tuned settings, then every tenant's stored history streamed into the worker (``TenantIndexes.load_all``,
within ``server.index_memory_bytes``; the backend returned loads an evicted tenant on its next request).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from reprise.backends.vllm.attach import MAX_SPECULATIVE_TOKENS, attach_reprise, model_folder
from reprise.backends.vllm.backend import VllmBackend
from reprise.backends.vllm.engine import VllmEngine, VllmSettings
from reprise.backends.vllm.tenants import WorkerTenants
from reprise.server.index_budget import IndexedBackend
from reprise.server.indexes import TenantIndexes
from reprise.server.metering import StepMeter
from reprise.server.tenant_config import apply_tenant_configs
from verifier.models import resolve_dtype, served_model_name

log = logging.getLogger(__name__)


class DrainingAccounting:
    """``TenantAccounting`` whose figures first take in the worker's latest steps (so `reprise index
    stats` right after a request counts it); everything else is the wrapped object's."""

    def __init__(self, inner: Any, backend: Any = None) -> None:
        self.inner = inner
        self.backend = backend

    def stats(self, tenant: str, index_resident: bool = True, **index_figures: int) -> Any:
        if self.backend is not None:
            try:
                self.backend.drain_steps()
            except Exception:
                log.debug("draining vLLM's step records failed", exc_info=True)
        return self.inner.stats(tenant, index_resident, **index_figures)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


VLLM_DRAFTERS = ("reprise", "hybrid")  # the model.drafter values the vllm engine drafts with


def fallback_head(drafter: str) -> Path | None:
    """The Medusa checkpoint of the neural fallback for ``model.drafter = "hybrid"``
    (``$REPRISE_DRAFTER_CHECKPOINT``, else ``$REPRISE_HOME/drafters/default``, as the own engine's hybrid
    drafter), or None: another drafter, or no checkpoint there (a warning: retrieval alone)."""
    if drafter != "hybrid":
        return None
    from neural_drafters.proposers import default_checkpoint

    path = default_checkpoint()
    if not path.exists():
        log.warning("model.drafter hybrid: no drafter checkpoint at %s (reprise train-drafter --kind mtp "
                    "--mtp-style medusa --out %s): the vllm engine drafts by retrieval alone", path, path)
        return None
    return path


def start_vllm(config: Any, store: Any, accounting: Any, metrics: Any, history_sink: Any,
               on_close: Any = None, on_fatal: Any = None, engine: VllmEngine | None = None) -> tuple[IndexedBackend, Any]:
    """The started vLLM backend and the ``TenantIndexes`` over the worker's drafting state. ``engine``:
    one already started (tests start theirs with ``enforce_eager``); the backend then owns it all the same."""
    if engine is not None:
        return wire_vllm(engine, config, store, accounting, metrics, history_sink, on_close, on_fatal=on_fatal)
    m = config.model
    folder = model_folder(m.path)
    drafting = (m.drafter or "reprise") in VLLM_DRAFTERS
    if not drafting:
        log.warning("model.drafter %r: the vllm engine drafts with Reprise's proposer (reprise, or hybrid "
                    "with a Medusa head) only; drafting is off", m.drafter)
    engine = VllmEngine(VllmSettings(
        model=folder, dtype=resolve_dtype(m.dtype, m.device), max_model_len=m.max_len, max_num_seqs=m.num_slots,
        num_speculative_tokens=min(config.drafting.max_draft_tokens, MAX_SPECULATIVE_TOKENS),
        speculation="reprise" if drafting else "off", tensor_parallel_size=m.tensor_parallel_size))
    try:
        return wire_vllm(engine, config, store, accounting, metrics, history_sink, on_close, on_fatal=on_fatal)
    except BaseException:
        engine.close()
        raise


def wire_vllm(engine: VllmEngine, config: Any, store: Any, accounting: Any, metrics: Any, history_sink: Any,
              on_close: Any = None, owns_engine: bool = True, on_fatal: Any = None) -> tuple[IndexedBackend, Any]:
    """Over a started engine: attach the proposer, load every tenant's history into the worker, and
    build the backend (``start_vllm`` without the engine start; tests share one engine)."""
    from transformers import AutoTokenizer  # lazily: the CLI and the transformers engine never need it here

    folder = engine.settings.model
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    metered = DrainingAccounting(accounting)
    tenants = WorkerTenants(engine) if engine.settings.speculation == "reprise" else None
    if tenants is not None:
        attach_reprise(engine, config.drafting, tokenizer, fallback_head=fallback_head(config.model.drafter))
        tuned = apply_tenant_configs(tenants, store.list_tenants(), config.home)
        if tuned:
            log.info("%d tenants draft with their own tuned settings", tuned)
    tokenize = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    indexes = TenantIndexes(store, tenants if tenants is not None else object(), metered, metrics, tokenize,
                            memory_budget_bytes=config.server.index_memory_bytes)
    indexes.load_all()
    backend = VllmBackend(engine, tokenizer, served_model_name(folder), accounting=accounting,
                          meter=StepMeter(accounting, metrics),
                          history_sink=history_sink, record_trajectory=indexes.record, on_close=on_close,
                          owns_engine=owns_engine, store_before_reply=config.server.store_before_reply,
                          on_fatal=on_fatal,
                          on_store_wait=metrics.observe_store_wait if metrics is not None else None)
    metered.backend = backend
    # A request's tenant is loaded (within server.index_memory_bytes) and pinned while it decodes.
    return IndexedBackend(backend, indexes), indexes
