"""Closed-loop gRPC clients for the load generator: one level (a client count) at a time.

`run_level` spawns the load generator's processes; each runs its share of the clients as
threads on blocking stubs over its own connections, and they all start on one signal, so that
connecting and warming up stay out of the measured time.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tfserve.bench.common import cpu_seconds, percentile_ms, process_cpu_seconds
from tfserve.client import encode_request, pb2_grpc, translate_request


@dataclass
class LevelResult:
    """One level's figures: latencies over the answered requests, rates over the level's
    wall time, CPU times per request (answered or failed)."""

    concurrency: int
    requests: int
    errors: int
    texts: int
    tokens: int
    seconds: float
    texts_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    error_codes: dict[str, int]
    processes: int = 1
    client_cpu_ms_per_request: float = float("nan")  # every load generator process
    server_cpu_ms_per_request: float | None = None  # with --server-pid
    requests_per_s: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)
    transport: str = "grpc"  # or "http": the HTTP API (tfserve.bench.http_loop)


@dataclass
class _Plan:
    """What one load generator process does (picklable: processes are spawned)."""

    target: str
    clients: int
    requests: Any  # multiprocessing.Value shared by the processes: requests still to send
    duration: float
    texts: list[str]
    texts_per_request: int
    options: dict[str, Any]
    token: str | None
    timeout: float
    seed: int
    rpc: str = "translate"  # "encode", or "health": Health.Check, the floor of any call
    connections: int = 1  # TCP connections of this process; its clients take turns over them
    transport: str = "grpc"  # or "http": target is the HTTP API's HOST:PORT


# the Translator method each --rpc calls (health: grpc.health.v1's Check)
RPC_METHODS = {"translate": "Translate", "encode": "Encode"}


def request_pool(plan: _Plan, rng: random.Random) -> list[Any]:
    """256 requests of plan.texts_per_request random texts each, built up front so that the
    timed loop costs only the call: TranslateRequests with plan.options, or EncodeRequests
    (of plan.options, only the model)."""
    pool = []
    for _ in range(256):
        texts = [rng.choice(plan.texts) for _ in range(plan.texts_per_request)]
        pool.append(encode_request(texts, model=plan.options.get("model", ""))
                    if plan.rpc == "encode" else translate_request(texts, **plan.options))
    return pool


def answer_counts(response: Any) -> tuple[int, int]:
    """(texts, tokens) of an answer: a TranslateResponse's best hypotheses' tokens, an
    EncodeResponse's embedded source tokens; (0, 0) for a health answer."""
    translations = getattr(response, "translations", ())
    if translations:
        return len(translations), sum(len(t.hypotheses[0].token_ids) for t in translations
                                      if t.hypotheses)
    embeddings = getattr(response, "embeddings", ())
    return len(embeddings), sum(len(e.token_ids) for e in embeddings)


def _client_process(plan: _Plan, ready: Any, start: Any, results: Any) -> None:
    """Closed-loop clients over plan.connections channels; puts (latencies, errors, texts,
    tokens, cpu, s)."""
    # channels to one target share one connection unless each has a subchannel pool of its own
    options = [("grpc.use_local_subchannel_pool", 1)] if plan.connections > 1 else []
    channels = [grpc.insecure_channel(plan.target, options=options)
                for _ in range(plan.connections)]
    metadata = [("authorization", f"Bearer {plan.token}")] if plan.token else []
    rng = random.Random(plan.seed)
    # requests are built up front so that the timed loop costs only the RPC itself
    pool: list[Any]
    if plan.rpc == "health":
        senders = [health_pb2_grpc.HealthStub(channel).Check for channel in channels]
        pool = [health_pb2.HealthCheckRequest(service="")]
    else:
        senders = [getattr(pb2_grpc.TranslatorStub(channel), RPC_METHODS[plan.rpc])
                   for channel in channels]
        pool = request_pool(plan, rng)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counts = {"texts": 0, "tokens": 0}
    lock = threading.Lock()
    for send in senders:  # warm each connection (HTTP/2 settings) before the clock starts
        try:
            send(pool[0], timeout=plan.timeout, metadata=metadata)
        except grpc.RpcError:
            pass
    ready.release()
    start.wait()
    cpu_before, started = cpu_seconds(), time.perf_counter()
    stop_at = started + plan.duration

    def client(index: int) -> None:
        turn = index
        send = senders[index % len(senders)]
        while time.perf_counter() < stop_at:
            with plan.requests.get_lock():
                if plan.requests.value <= 0:
                    return
                plan.requests.value -= 1
            request = pool[turn % len(pool)]
            turn += plan.clients
            sent = time.perf_counter()
            try:
                response = send(request, timeout=plan.timeout, metadata=metadata)
            except grpc.RpcError as error:
                code = error.code().name if hasattr(error, "code") else "UNKNOWN"
                with lock:
                    errors[code] = errors.get(code, 0) + 1
                continue
            elapsed = time.perf_counter() - sent
            texts, tokens = answer_counts(response)
            with lock:
                latencies.append(elapsed)
                counts["texts"] += texts
                counts["tokens"] += tokens

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(plan.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    cpu = cpu_seconds() - cpu_before
    for channel in channels:
        channel.close()
    results.put((latencies, errors, counts["texts"], counts["tokens"], cpu, seconds))


def run_level(target: str, concurrency: int, requests: int, duration: float,
              texts: Sequence[str], texts_per_request: int, options: dict[str, Any],
              token: str | None = None, timeout: float = 60.0, processes: int = 0,
              server_pid: int | None = None, rpc: str = "translate",
              connections: int = 0, transport: str = "grpc") -> LevelResult:
    """One closed-loop run with `concurrency` clients spread over `processes` processes.

    processes 0: one per core, at most one per client. Several processes keep the load
    generator's own Python (one interpreter lock per process) from capping the load.
    connections: TCP connections in all, spread over the processes (0: one per process); a
    server with --workers balances connections, not calls, so give it several.
    transport "http": the same clients and requests over the HTTP API (target: its
    HOST:PORT), one connection per client (HTTP/1.1 carries one call at a time).
    """
    if transport == "http":
        from tfserve.bench.http_loop import http_client_process

        process_main: Any = http_client_process
    else:
        process_main = _client_process
    processes = max(1, min(concurrency, processes or (os.cpu_count() or 1)))
    context = multiprocessing.get_context("spawn")  # no fork after gRPC has started threads
    remaining = context.Value("q", requests)
    ready, start, results = context.Semaphore(0), context.Event(), context.Queue()
    workers = []
    for index in range(processes):
        clients = concurrency // processes + (1 if index < concurrency % processes else 0)
        links = max(1, connections // processes + (1 if index < connections % processes else 0))
        plan = _Plan(target, clients, remaining, duration, list(texts), texts_per_request,
                     options, token, timeout, seed=concurrency * 1000 + index, rpc=rpc,
                     connections=min(links, clients), transport=transport)
        worker = context.Process(target=process_main, args=(plan, ready, start, results),
                                 daemon=True)
        worker.start()
        workers.append(worker)
    for _ in workers:
        ready.acquire()
    server_before = process_cpu_seconds(server_pid) if server_pid else None
    start.set()
    latencies: list[float] = []
    errors: dict[str, int] = {}
    texts_done = tokens = 0
    cpu = seconds = 0.0
    for _ in workers:
        part_latencies, part_errors, part_texts, part_tokens, part_cpu, part_seconds = (
            results.get(timeout=duration + timeout + 60))
        latencies += part_latencies
        for code, count in part_errors.items():
            errors[code] = errors.get(code, 0) + count
        texts_done += part_texts
        tokens += part_tokens
        cpu += part_cpu
        seconds = max(seconds, part_seconds)
    server_after = process_cpu_seconds(server_pid) if server_pid else None
    for worker in workers:
        worker.join()
    done = len(latencies) + sum(errors.values())
    server_cpu = (round((server_after - server_before) / max(done, 1) * 1000.0, 3)
                  if server_before is not None and server_after is not None else None)
    return LevelResult(
        concurrency=concurrency, requests=done, errors=sum(errors.values()),
        texts=texts_done, tokens=tokens, seconds=round(seconds, 3),
        texts_per_s=round(texts_done / seconds, 2), tokens_per_s=round(tokens / seconds, 1),
        requests_per_s=round(done / seconds, 1),
        p50_ms=percentile_ms(latencies, 50), p99_ms=percentile_ms(latencies, 99),
        error_codes=errors, processes=processes,
        client_cpu_ms_per_request=round(cpu / max(done, 1) * 1000.0, 3),
        server_cpu_ms_per_request=server_cpu, transport=transport)

