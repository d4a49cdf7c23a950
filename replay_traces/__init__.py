"""replay_traces: offline measurement of drafters on recorded agent traffic (docs/replay.md).

- ``traces``: reading trace files (docs/replay.md, "Traces") into ``Call`` records
- ``tokenizer``: the canonical cl100k_base prompt/response tokenization, cached per message
- ``replay``: the canonical replay engine (propose, greedy verify, commit, record) and its ``ReplayReport``
- ``oracle``: the copy-limit oracle, the ceiling of every retrieval drafter
- ``tune`` / ``tune_report``: sweeps of ``DraftingConfig`` under a cost model, PNG and HTML reports

Nothing is imported here, so ``import replay_traces`` stays cheap; import the modules you need.
"""
