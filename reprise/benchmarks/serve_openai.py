"""The OpenAI-compatible API's part of `reprise bench serve --api openai` (run in the load process).

* ``drive_openai``: the same load as the gRPC pass (the same token-id prompts, token budget, sessions
  and concurrency) through ``POST /v1/completions`` streamed over server-sent events with the official
  ``openai`` client, so the two passes differ only in the front the requests take.
* ``drive_tool_calls``: chat completions with the benchmark's airline tools and ``tool_choice``
  "required"; every reply is checked: it parses into one tool call whose arguments are valid under the
  tool's JSON Schema (``jsonschema``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

# The airline tools of the synthetic prompts as JSON Schemas, for the forced-call pass.
TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "search_flights", "description": "Flights between two airports on a date",
     "parameters": {"type": "object", "properties": {
         "origin": {"type": "string", "enum": ["SFO", "JFK", "LHR", "CDG", "NRT", "SYD"]},
         "destination": {"type": "string", "enum": ["GRU", "JNB", "DXB", "SIN", "ORD", "MEX"]},
         "date": {"type": "string", "pattern": "^2026-12-[0-2][0-9]$"}},
         "required": ["origin", "destination", "date"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_reservation", "description": "A reservation by its id",
     "parameters": {"type": "object", "properties": {"reservation_id": {"type": "string", "pattern": "^R[0-9]{4}$"}},
                    "required": ["reservation_id"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "cancel_reservation", "description": "Cancel a reservation",
     "parameters": {"type": "object", "properties": {
         "reservation_id": {"type": "string", "pattern": "^R[0-9]{4}$"},
         "refund": {"type": "boolean"}}, "required": ["reservation_id", "refund"], "additionalProperties": False}}},
]


async def drive_openai(job: dict[str, Any]) -> dict[str, Any]:
    import openai

    clients = [openai.AsyncOpenAI(api_key=key, base_url=job["base_url"], max_retries=0, timeout=3600)
               for key in job["keys"]]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(job["prompts"])):
        queue.put_nowait(i)
    records: list[dict[str, Any]] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            client = clients[i % len(clients)]
            t0 = time.perf_counter()
            first = last = None
            n = 0
            try:
                stream = await client.completions.create(
                    model=job["model"], prompt=job["prompts"][i], max_tokens=job["max_new_tokens"], stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"prompt_cache_key": f"bench-{i % 7}",
                                "speculation": "auto" if job["speculation"] else "off"})
                async for chunk in stream:
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
                    if not chunk.choices or not chunk.choices[0].text:
                        continue
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                per_token = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
                records.append({"ttft": None if first is None else first - t0, "e2e": time.perf_counter() - t0,
                                "tokens": n, "per_token": per_token, "error": None})
            except openai.APIStatusError as exc:
                records.append({"error": str(exc.status_code), "message": exc.message, "e2e": time.perf_counter() - t0})
            except openai.APIError as exc:
                records.append({"error": type(exc).__name__, "message": str(exc), "e2e": time.perf_counter() - t0})

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(job["concurrency"])))
    wall = time.perf_counter() - start
    for c in clients:
        await c.close()
    return {"wall_s": wall, "records": records}


async def drive_tool_calls(job: dict[str, Any]) -> dict[str, Any]:
    import jsonschema
    import openai

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
    client = openai.AsyncOpenAI(api_key=job["keys"][0], base_url=job["base_url"], max_retries=0, timeout=3600)
    semaphore = asyncio.Semaphore(job["concurrency"])
    outcomes: list[str] = []

    async def one(i: int) -> None:
        messages: Any = job["chats"][i % len(job["chats"])]
        tools: Any = TOOL_SCHEMAS
        async with semaphore:
            try:
                done = await client.chat.completions.create(
                    model=job["model"], messages=messages, tools=tools, tool_choice="required",
                    max_tokens=job["tool_max_tokens"], extra_body={"prompt_cache_key": f"tools-{i % 7}"})
            except openai.APIError as exc:
                outcomes.append(f"error: {exc}")
                return
        calls: list[Any] = list(done.choices[0].message.tool_calls or [])
        if done.choices[0].finish_reason != "tool_calls" or len(calls) != 1:
            outcomes.append(f"unparsed ({done.choices[0].finish_reason})")
            return
        try:
            args = json.loads(calls[0].function.arguments)
            jsonschema.validate(args, schemas[calls[0].function.name])
        except (ValueError, KeyError, jsonschema.ValidationError) as exc:
            outcomes.append(f"invalid: {exc}"[:200])
            return
        outcomes.append("valid")

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(job["tool_requests"])))
    wall = time.perf_counter() - start
    await client.close()
    valid = outcomes.count("valid")
    return {"requests": len(outcomes), "valid": valid, "valid_share": valid / len(outcomes) if outcomes else None,
            "failures": sorted({o for o in outcomes if o != "valid"})[:5], "wall_s": wall}
