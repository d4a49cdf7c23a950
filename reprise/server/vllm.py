"""How the service starts on vLLM (``model.engine = "vllm"``): engine, drafting state, backend.

    engine = start_vllm_engine(config)                       # vLLM's processes start and compile
    tenants, tokenizer = attach_tenants(engine, config, store)   # Reprise's proposer in the worker
    backend = vllm_backend(engine, tokenizer, config, accounting, ...)

Order: the model folder (``model.path``, or the default SmolLM2 converted once to safetensors by
``verifier.models``), the engine (tens of seconds to minutes), the proposer attached in the worker with
the drafting settings and the tokenizer's vocabulary, and each tenant's tuned settings. The service
(``reprise.service``) then chooses the indexes over the worker's state: ``TenantIndexes`` streams every
tenant's stored history into the worker at start-up (within ``server.index_memory_bytes``), or on a
replica ``reprise.cluster`` loads each tenant lazily from its sealed snapshot and stream, exactly as
for the own engine (``WorkerTenants`` is the proposer both see).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from reprise.backends.vllm.attach import MAX_SPECULATIVE_TOKENS, attach_reprise, model_folder
from reprise.backends.vllm.backend import VllmBackend
from reprise.backends.vllm.engine import VllmEngine, VllmSettings
from reprise.backends.vllm.tenants import WorkerTenants
from reprise.server.metering import StepMeter
from reprise.server.tenant_config import apply_tenant_configs
from verifier.models import resolve_dtype, served_model_name

log = logging.getLogger(__name__)

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


def start_vllm_engine(config: Any) -> VllmEngine:
    """vLLM's engine as ``config.model`` describes it, Reprise's proposer its drafter unless
    ``model.drafter`` names one the vllm engine cannot draft with (then drafting is off)."""
    m = config.model
    folder = model_folder(m.path)
    drafting = (m.drafter or "reprise") in VLLM_DRAFTERS
    if not drafting:
        log.warning("model.drafter %r: the vllm engine drafts with Reprise's proposer (reprise, or hybrid "
                    "with a Medusa head) only; drafting is off", m.drafter)
    return VllmEngine(VllmSettings(
        model=folder, dtype=resolve_dtype(m.dtype, m.device), max_model_len=m.max_len, max_num_seqs=m.num_slots,
        num_speculative_tokens=min(config.drafting.max_draft_tokens, MAX_SPECULATIVE_TOKENS),
        speculation="reprise" if drafting else "off", tensor_parallel_size=m.tensor_parallel_size,
        enforce_eager=not m.compile))


def attach_tenants(engine: VllmEngine, config: Any, store: Any) -> tuple[WorkerTenants | None, Any]:
    """The proxy of the worker's per-tenant drafting state (None when the engine does not draft with
    Reprise's proposer) with the proposer attached and tuned settings applied; and the tokenizer."""
    from transformers import AutoTokenizer  # lazily: the CLI and the transformers engine never need it here

    tokenizer = AutoTokenizer.from_pretrained(engine.settings.model, local_files_only=True)
    if engine.settings.speculation != "reprise":
        return None, tokenizer
    tenants = WorkerTenants(engine)
    attach_reprise(engine, config.drafting, tokenizer, fallback_head=fallback_head(config.model.drafter))
    tuned = apply_tenant_configs(tenants, store.list_tenants(), config.home)
    if tuned:
        log.info("%d tenants draft with their own tuned settings", tuned)
    return tenants, tokenizer


def vllm_backend(engine: VllmEngine, tokenizer: Any, config: Any, accounting: Any, metrics: Any, history_sink: Any,
                 record_trajectory: Any, *, index_turns: bool = True, on_close: Any = None,
                 on_fatal: Any = None, owns_engine: bool = True) -> VllmBackend:
    """The backend over a started engine; reading ``accounting``'s figures first takes in the worker's
    latest steps (so `reprise index stats` right after a request counts it)."""
    backend = VllmBackend(engine, tokenizer, served_model_name(engine.settings.model), accounting=accounting,
                          meter=StepMeter(accounting, metrics), history_sink=history_sink,
                          record_trajectory=record_trajectory, on_close=on_close, owns_engine=owns_engine,
                          store_before_reply=config.server.store_before_reply, on_fatal=on_fatal,
                          on_store_wait=metrics.observe_store_wait if metrics is not None else None,
                          index_turns=index_turns)
    accounting.refresh = backend.drain_steps
    return backend
