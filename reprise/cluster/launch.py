"""A replica process for tests and ``reprise bench cluster``: ``reprise serve`` with an optional tiny
random model, announcing its ports on stdout once it serves.

    python -m reprise.cluster.launch --tiny --home DIR --grpc-port 0 --store-backend redis \\
        --store-redis-url redis://127.0.0.1:6399/0 --cluster-enabled
    # stdout: {"ready": true, "grpc_port": 41234, "http_port": 0, "pid": 777}

Every ``reprise serve`` flag works (settings also from REPRISE_* and the TOML file). ``--tiny`` serves
``reprise.tiny``'s random Llama (same seed, same weights, on every replica: outputs agree across
replicas). SIGTERM stops gracefully, as ``reprise serve`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from reprise.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser(prog="python -m reprise.cluster.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="serve reprise.tiny's random Llama")
    parser.add_argument("--tiny-seed", type=int, default=7, help="its seed (default 7)")
    parser.add_argument("--log-level", default="WARNING", help="log level on stderr (default WARNING)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return asyncio.run(_serve(config, args))


async def _serve(config, args: argparse.Namespace) -> int:
    from reprise.service import Service

    model = None
    if args.tiny:
        from reprise.tiny import tiny_loaded_model

        model = tiny_loaded_model(args.tiny_seed)
    service = Service(config, model=model, model_name="tiny-llama" if args.tiny else "")
    await service.start()
    service.install_signal_handlers()
    print(json.dumps({"ready": True, "grpc_port": service.grpc_port, "http_port": service.http_port,
                      "pid": os.getpid()}), flush=True)
    await service.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
