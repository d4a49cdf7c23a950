"""The OpenAI Agents SDK, unchanged, running a tool-using agent on Reprise's OpenAI-compatible API.

What it needs: a running server (`make run`, or `.venv/bin/reprise serve`), a tenant's API key, and the
`openai-agents` package (`make run` / `make test` install it into .venv with the dev extra; elsewhere
`pip install openai-agents`). From the repository root, in another shell:

    .venv/bin/reprise tenant create demo               # prints the tenant's API key (the admin key is read
                                                       # from ~/.reprise/admin.key, written on first start)
    REPRISE_API_KEY=rpk_... .venv/bin/python examples/openai_agents_loop.py --tasks 3
    REPRISE_API_KEY=rpk_... .venv/bin/python examples/openai_agents_loop.py --api chat   # chat completions

Only the client changes: ``AsyncOpenAI(base_url="http://127.0.0.1:50052/v1", api_key=<tenant key>)``
handed to the SDK's default model class (``OpenAIResponsesModel``: the Responses API, ``/v1/responses``)
or, with ``--api chat``, to ``OpenAIChatCompletionsModel``. The agent's first turn forces a call of its
function tool (``tool_choice="required"``: Reprise's grammar guarantees the call parses and its
arguments match the tool's schema, even from a 135M model); the SDK then resets the choice to auto and
the model answers from the tool's output. Every task runs in one agent session (``prompt_cache_key``),
so from the second task on Reprise drafts the repeated prompt, tool-call shape and answer from the
tenant's history. With an admin key (--admin-key or REPRISE_ADMIN_KEY) the tenant's hit rate and tau
are printed from the admin plane at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Literal

CITIES = ("Paris", "Lisbon", "Oslo", "Lima")
WEATHER = {"Paris": (14, "cloudy"), "Lisbon": (19, "sunny"), "Oslo": (3, "snow"), "Lima": (22, "humid")}


async def run(args: argparse.Namespace) -> int:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers otherwise

    @function_tool
    def get_weather(city: Literal["Paris", "Lisbon", "Oslo", "Lima"]) -> str:
        """Today's temperature (Celsius) and sky in a city."""
        temp, sky = WEATHER[city]
        return json.dumps({"city": city, "temperature_c": temp, "sky": sky})

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)
    served = (await client.models.list()).data[0].id
    model_class = OpenAIChatCompletionsModel if args.api == "chat" else OpenAIResponsesModel
    model = model_class(model=served, openai_client=client)
    agent = Agent(name="weather", model=model, tools=[get_weather],
                  instructions="You answer questions about the weather. Call get_weather, then answer in one "
                               "sentence using its result.",
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=args.max_tokens,
                                               extra_body={"prompt_cache_key": args.session}))
    print(f"model {served} at {args.base_url} ({args.api} API)")
    for task in range(args.tasks):
        city = CITIES[task % len(CITIES)]
        t0 = time.perf_counter()
        result = await Runner.run(agent, f"What is the weather like in {city} today?", max_turns=4)
        calls = [item.raw_item.arguments for item in result.new_items if item.type == "tool_call_item"]
        print(f"task {task + 1}: {time.perf_counter() - t0:.1f} s, tool calls {calls}, "
              f"answer: {str(result.final_output).strip()[:160]!r}")
    await client.close()
    if args.admin_key:
        from grpc_api.client import AdminClient

        with AdminClient(args.grpc_server, args.admin_key) as admin:
            for s in admin.index_stats():
                if s.num_requests:
                    print(f"tenant {s.tenant_id[:8]}: {s.num_requests} requests, hit rate {s.hit_rate:.2f}, "
                          f"tau {s.tau:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("REPRISE_BASE_URL", "http://127.0.0.1:50052/v1"))
    parser.add_argument("--api-key", default=os.environ.get("REPRISE_API_KEY"), help="tenant API key (rpk_...)")
    parser.add_argument("--admin-key", default=os.environ.get("REPRISE_ADMIN_KEY"),
                        help="admin key, to print the tenant's drafting figures at the end")
    parser.add_argument("--grpc-server", default=os.environ.get("REPRISE_SERVER", "127.0.0.1:50051"))
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--api", choices=("responses", "chat"), default="responses",
                        help="the Responses API (the SDK's default) or chat completions")
    parser.add_argument("--session", default="weather-agent")
    args = parser.parse_args(argv)
    if not args.api_key:
        print("set REPRISE_API_KEY or pass --api-key (reprise tenant create NAME prints one)", file=sys.stderr)
        return 2
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
