"""Call selection for the model benchmarks and the hybrid's tuning."""

from __future__ import annotations

from reprise.offline import calls


def test_task_key_groups_trials() -> None:
    assert calls.task_key("task3-trial1", "x") == calls.task_key("task3-trial0", "y") == "task3"
    assert calls.task_key("ep7-trial2", "Question: Q?") == calls.task_key("ep9-trial3", "Question: Q?")
