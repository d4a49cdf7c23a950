"""verifier: the target model runner (docs/verifier.md).

- ``verifier.models``: ``load_model(path)``, ``load_default_model()`` (SmolLM2-135M-Instruct).
- ``verifier.runner``: ``ModelRunner`` (slotted KV cache, packed tree verification), ``VerifyStep``,
  ``VerifyResult``.
- ``verifier.sampling``: ``SamplingParams`` and the per-row logits processors.
- ``verifier.acceptance``: greedy / deterministic-draft walk and SpecInfer/Sequoia rejection sampling.
- ``verifier.tree``: tree rows, positions, ancestor masks, the float additive mask.
- ``verifier.kernels``: Triton tree attention and KV compaction, each beside its torch reference.
- ``verifier.testing``: tiny random models and transformers references for tests.

Importing the package itself imports nothing; its modules import torch and transformers at top. Triton
is imported only when a kernel is compiled (an optional extra, and ``TRITON_INTERPRET`` must be set
before it loads).
"""
