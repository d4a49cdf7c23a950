"""Decode backends: what the serving core (``serving.core``, below both fronts) talks to through the
``serving.backend.DecodeBackend`` protocol. ``engine`` runs Reprise's own engine on a thread; ``vllm``
runs vLLM's engine with Reprise's proposer in its worker."""
