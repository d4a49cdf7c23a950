"""The ``vllm`` decode backend: vLLM decodes, Reprise drafts (docs/vllm.md).

``backend.VllmBackend`` implements ``serving.backend.DecodeBackend`` over vLLM's engine
(``engine.VllmEngine``); ``proposer.RepriseVllmProposer`` is Reprise's drafter as vLLM's speculative
proposer and ``worker.RepriseWorkerExtension`` the service's channel into vLLM's worker process.
Nothing here imports vLLM at module import time (``versions.require_vllm`` checks it first).
"""
