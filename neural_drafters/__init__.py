"""Neural drafters for where retrieval has nothing: EAGLE-style and MTP heads over the target's hidden
states (``heads``, ``drafting``), their training and checkpoints, hidden-state keyed reuse (``reuse``),
and the hybrid proposer that runs them beside retrieval (``hybrid``, ``proposers``). See
docs/neural_drafters.md."""
