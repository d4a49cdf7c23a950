"""Reprise's own decoding engine: requests, the step (admit, propose, verify, postprocess), stopping and
the draft budget. It drives a ``verifier.runner.ModelRunner`` and a ``retrieval`` proposer."""
