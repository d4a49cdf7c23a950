"""An agent loop against a running Reprise server: several tasks, each a few model/tool turns.

    make run                                           # or .venv/bin/reprise serve (admin key: ~/.reprise/admin.key)
    .venv/bin/reprise tenant create demo               # in another shell: prints the tenant's API key
    REPRISE_API_KEY=rpk_... .venv/bin/python examples/agent_loop.py --tasks 4

The agent repeats itself the way real agents do (same system prompt, same tool-call shapes, similar
observations), so from the second task on, Reprise drafts from the tenant's own earlier turns and more
tokens are committed per model step. Pass an admin key (--admin-key or REPRISE_ADMIN_KEY) to print the
tenant's hit rate and tau from the admin plane at the end; the data plane never reveals them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid

from grpc_api.client import AdminClient, RepriseClient, RepriseError

SYSTEM = (
    "You are a careful operations agent. To look something up, answer with exactly one line "
    'ACTION: lookup {"city": "<name>"} and wait for the OBSERVATION. When you know the answer, reply '
    "FINAL: <one sentence>."
)
CITIES = ["Paris", "Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Quito", "Perth"]
WEATHER = {c: (12 + 3 * i % 17, ["sunny", "cloudy", "rainy", "windy"][i % 4]) for i, c in enumerate(CITIES)}


def lookup(city: str) -> str:
    """The 'tool': a deterministic weather table."""
    if city not in WEATHER:
        return json.dumps({"error": f"unknown city {city!r}"})
    temp, sky = WEATHER[city]
    return json.dumps({"city": city, "temperature_c": temp, "sky": sky, "source": "demo-weather-v1"})


def run_task(client: RepriseClient, city: str, session_id: str, max_turns: int, max_new_tokens: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is the weather in {city} right now?"}]
    tokens = 0
    start = time.perf_counter()
    for turn in range(max_turns):
        stream = client.generate_stream(messages=messages, session_id=session_id, max_new_tokens=max_new_tokens,
                                        stop=["OBSERVATION:"], temperature=0.0)
        reply = "".join(chunk.text for chunk in stream)  # tokens arrive as they are committed
        tokens += stream.completion.completion_tokens
        messages.append({"role": "assistant", "content": reply})
        match = re.search(r'ACTION:\s*lookup\s*(\{.*?\})', reply)
        if match is None:  # a final answer (or a model that ignored the format): the task ends
            break
        try:
            city_arg = json.loads(match.group(1)).get("city", "")
        except json.JSONDecodeError:
            city_arg = ""
        observation = f"OBSERVATION: {lookup(city_arg)}"
        messages.append({"role": "user", "content": observation})
        # Tool output never went through Generate: add it to the tenant's history so later tasks can
        # draft from it too.
        client.append_trajectory(session_id, text=observation)
    seconds = time.perf_counter() - start
    return {"city": city, "turns": turn + 1, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=os.environ.get("REPRISE_SERVER", "127.0.0.1:50051"))
    parser.add_argument("--api-key", default=os.environ.get("REPRISE_API_KEY"), help="tenant API key (rpk_...)")
    parser.add_argument("--admin-key", default=os.environ.get("REPRISE_ADMIN_KEY"),
                        help="optional admin key: print the tenant's figures from the admin plane at the end")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error("no API key: pass --api-key or set REPRISE_API_KEY (reprise tenant create NAME prints one)")
    with RepriseClient(args.server, args.api_key, timeout=600) as client:
        try:
            info = client.model_info()
        except RepriseError as exc:
            print(f"cannot use the server at {args.server}: {exc}", file=sys.stderr)
            return 1
        print(f"model {info.model_name}, context {info.max_context_tokens} tokens")
        for i in range(args.tasks):
            result = run_task(client, CITIES[i % len(CITIES)], f"demo-{uuid.uuid4().hex[:8]}", args.max_turns,
                              args.max_new_tokens)
            print(f"task {i + 1}: {result['city']:<8} {result['turns']} turns, {result['tokens']:>4} tokens, "
                  f"{result['tokens_per_s']:6.1f} tokens/s")
    if args.admin_key:
        with AdminClient(args.server, args.admin_key) as admin:
            for s in admin.index_stats():
                print(f"tenant {s.tenant_id[:8]}: hit rate {s.hit_rate:.0%}, tau {s.tau:.2f}, "
                      f"{s.num_accepted_tokens}/{s.num_draft_tokens} draft tokens accepted, "
                      f"index {s.index_tokens} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
