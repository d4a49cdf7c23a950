"""`reprise bench <area>`: benchmarks that print figures (JSON with --json), never timed tests.

Each area lives in ``reprise.benchmarks.<area>`` with ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

from reprise.benchmarks import agent, attack, cluster, engine, index, neural, serve, store, verify

AREAS = {  # name -> (module, help line), in the order --help shows them
    "index": (index, "native suffix index: insert tokens/s, bytes per token, speculate latency"),
    "verify": (verify, "verifier: step cost by tree size, end-to-end tokens/s with and without speculation"),
    "agent": (agent, ("whole agent sessions: tokens/s and time to first token with prefix reuse and drafts vs "
                      "generate")),
    "store": (store, "encrypted history store: records/s, bytes per token, encryption share"),
    "serve": (serve, "gRPC service: throughput, TTFT and per-token latency under concurrency"),
    "cluster": (cluster, "replicas on one Redis: throughput, propagation delay, cold start"),
    "neural": (neural, ("neural drafters on traces with the target: tau and tokens/s for retrieval, head, "
                        "reuse, hybrid")),
    "engine": (engine, ("vLLM plain, ngram, suffix, vLLM + Reprise's proposer, Reprise's engine: tokens/s at 1 "
                        "and 8 concurrent")),
    "attack": (attack, ("a hostile client's floods against a real server: outcome, peak RSS, health and a normal "
                        "tenant's latency under each")),
}


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="run a benchmark and print its figures", description=__doc__)
    areas = parser.add_subparsers(dest="area", metavar="AREA")
    for area, (module, help_text) in AREAS.items():
        p = areas.add_parser(area, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
