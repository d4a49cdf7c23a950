"""The worker extension ``reprise bench engine`` installs in its vLLM engines: the service's
(``reprise.backends.vllm.worker.RepriseWorkerExtension``) plus what only a benchmark pass needs."""

from __future__ import annotations

from reprise.backends.vllm.worker import RepriseWorkerExtension

BENCH_WORKER_EXTENSION = "reprise.benchmarks.vllm_worker.BenchWorkerExtension"


class BenchWorkerExtension(RepriseWorkerExtension):
    def reprise_reset_suffix_tree(self) -> int:
        """Replace vLLM's suffix drafter's cache (its global tree of past responses and the live requests'
        prompt trees) with an empty one of the same shape, so that every pass of ``vllm_suffix`` starts
        from nothing; returns how many cached responses it held. Only between requests."""
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, SuffixDecodingProposer):
            raise RuntimeError("vLLM's speculative proposer is not its suffix drafter (method 'suffix')")  # noqa: TRY004
        old = drafter.suffix_cache
        drafter.suffix_cache = SuffixDecodingCache(max_tree_depth=old.max_tree_depth,
                                                   max_cached_requests=old.max_cached_requests)
        return len(old.cached_requests)
