"""Closed-loop HTTP clients for the load generator: the HTTP API's side of a level.

One load generator process runs its share of the clients as coroutines on one event loop
(uvloop when installed) over one aiohttp session; HTTP/1.1 carries one call at a time per
connection, so each client keeps a connection of its own. The requests are the gRPC
clients' (tfserve.bench.closed_loop, same texts, options and seed) in their JSON mapping, and
the figures go back in the same shape, so that `run_level` reports both transports alike.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp
from google.protobuf import json_format

from tfserve.bench.closed_loop import request_pool
from tfserve.bench.common import cpu_seconds


def http_client_process(plan: Any, ready: Any, start: Any, results: Any) -> None:
    """The HTTP counterpart of closed_loop._client_process: same plan, same results."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(_clients(plan, ready, start, results))


async def _clients(plan: Any, ready: Any, start: Any, results: Any) -> None:
    rng = random.Random(plan.seed)
    url = f"http://{plan.target}"
    headers = {"x-request-timeout-ms": str(max(1, int(plan.timeout * 1000)))}
    if plan.token:
        headers["Authorization"] = f"Bearer {plan.token}"
    # requests are built up front (as the gRPC clients' are) so that the timed loop costs
    # only the call itself
    if plan.rpc == "health":
        method, path, pool = "GET", "/healthz", [b""]
    else:
        method, path = "POST", f"/v1/{plan.rpc}"  # /v1/translate or /v1/encode
        headers["Content-Type"] = "application/json"
        pool = [json.dumps(json_format.MessageToDict(request)).encode()
                for request in request_pool(plan, rng)]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counts = {"texts": 0, "tokens": 0}
    connector = aiohttp.TCPConnector(limit=plan.clients)
    timeout = aiohttp.ClientTimeout(total=plan.timeout)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout,
                                     headers=headers) as session:

        async def send(body: bytes) -> tuple[int, Any]:
            async with session.request(method, path, data=body or None) as response:
                return response.status, await response.json()

        # open every client's connection before the clock starts
        await asyncio.gather(*(send(pool[0]) for _ in range(plan.clients)),
                             return_exceptions=True)
        ready.release()
        start.wait()  # nothing else runs on this loop yet
        cpu_before, started = cpu_seconds(), time.perf_counter()
        stop_at = started + plan.duration

        async def client(index: int) -> None:
            turn = index
            while time.perf_counter() < stop_at:
                with plan.requests.get_lock():
                    if plan.requests.value <= 0:
                        return
                    plan.requests.value -= 1
                body = pool[turn % len(pool)]
                turn += plan.clients
                sent = time.perf_counter()
                try:
                    status, answer = await send(body)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
                    code = type(error).__name__
                    errors[code] = errors.get(code, 0) + 1
                    continue
                if status != 200:
                    code = str((answer or {}).get("error", {}).get("code", f"HTTP {status}"))
                    errors[code] = errors.get(code, 0) + 1
                    continue
                latencies.append(time.perf_counter() - sent)
                # a translation's best hypothesis' tokens, an embedding's source tokens;
                # nothing in a health answer
                translations = answer.get("translations", ())
                embeddings = answer.get("embeddings", ())
                counts["texts"] += len(translations) + len(embeddings)
                counts["tokens"] += sum(len(t["hypotheses"][0].get("tokenIds", ()))
                                        for t in translations if t.get("hypotheses"))
                counts["tokens"] += sum(len(e.get("tokenIds", ())) for e in embeddings)

        await asyncio.gather(*(client(i) for i in range(plan.clients)))
        seconds = time.perf_counter() - started
        cpu = cpu_seconds() - cpu_before
    results.put((latencies, errors, counts["texts"], counts["tokens"], cpu, seconds))
