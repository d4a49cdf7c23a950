"""Writes trajectories in a loop, printing each one's index after append returns (= acknowledged).

Run by test_kill9.py, which kills it with SIGKILL at a random moment.
argv: store config (JSON), master key (base64), tenant id, first index.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from privacy import StoreConfig, TenantId, open_store


def main() -> None:
    config = StoreConfig.from_dict(json.loads(sys.argv[1]))
    store = open_store(config, env={"REPRISE_MASTER_KEY": sys.argv[2]})
    tenant = TenantId(sys.argv[3])
    i = int(sys.argv[4])
    while True:
        ids = (np.arange(20_000) + i) % 50_000  # ~40 KB records: the kill often lands mid-write
        store.append_trajectory(tenant, f"session-{i}", ids, f"record {i}")
        sys.stdout.write(f"{i}\n")
        sys.stdout.flush()
        i += 1


if __name__ == "__main__":
    main()
