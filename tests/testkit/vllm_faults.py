"""A worker extension for tests: Reprise's extension plus a way to make its proposer fail.

Lives in the tests (it is no part of the product): the test engine names it as its
``worker_extension`` and calls ``reprise_test_fault`` through ``collective_rpc``. vLLM's worker
processes import it by name (they inherit the test run's ``sys.path``).
"""

from __future__ import annotations

import time
from typing import Any

from reprise.backends.vllm.worker import RepriseWorkerExtension

FAULTY_EXTENSION = "testkit.vllm_faults.FaultyWorkerExtension"


class FaultyWorkerExtension(RepriseWorkerExtension):
    def reprise_test_fault(self, mode: str, seconds: float = 0.0) -> None:
        """"raise": every drafting step raises; "stall": every drafting step sleeps ``seconds`` (with a
        0.2 s deadline); "": back to normal."""
        proposer: Any = self._reprise_proposer()
        vars(proposer).pop("_draft_step", None)  # the class's own method again
        if mode == "raise":
            def fail(*args: Any) -> Any:
                raise RuntimeError("injected drafting failure")

            proposer._draft_step = fail
        elif mode == "stall":
            original = type(proposer)._draft_step

            def stall(*args: Any) -> Any:
                time.sleep(seconds)
                return original(proposer, *args)

            proposer.stall_timeout_s = 0.2
            proposer._draft_step = stall
        elif mode == "":
            from reprise.backends.vllm.proposer import DEFAULT_STALL_TIMEOUT_S

            proposer.stall_timeout_s = DEFAULT_STALL_TIMEOUT_S
        else:
            raise ValueError(f"unknown fault mode {mode!r}")
