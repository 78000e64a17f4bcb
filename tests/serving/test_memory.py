"""Memory held for a large request is handed back when the request ends (docs/server.md,
Memory): a server's resident memory after a series of refused requests of nearly
--max-message-bytes stays within a couple of such messages of what it was after a warm-up
of the same requests, over gRPC and over HTTP.

A real `python -m tfserve serve` process on loopback; its VmRSS is read from /proc (Linux).
Each measurement waits for the server to say that the memory of every large request sent so
far was handed back (tfserve_large_requests_trimmed_total, on the HTTP port's /metrics),
never for time. Also, without a server: FreedMemory's accounting (one trim once the large
requests in flight have all ended, none while one runs).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from server_helpers import ServerProcess, free_port, rss_bytes, server_args

from tfserve.bench.common import scraped_value
from tfserve.proto import translator_pb2 as pb2
from tfserve.proto import translator_pb2_grpc as pb2_grpc
from tfserve.serving.calls import LARGE_REQUEST_BYTES, FreedMemory
from tfserve.telemetry.metrics import Metrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads VmRSS from /proc")

MESSAGE_BYTES = 15_000_000  # under the default --max-message-bytes (16 MiB)
WARM_UP = 5  # requests before the reference figure
REQUESTS = 60  # requests after it (the ratchet grew by hundreds of MB in as many)
ALLOWED_MESSAGES = 2  # growth allowed, in messages of MESSAGE_BYTES
TRIMMED = "tfserve_large_requests_trimmed_total"


def wait_trimmed(server: ServerProcess, count: int, timeout: float = 300.0) -> None:
    """Until the server handed back the memory of `count` large requests: scraped again
    after every answer, no sleeps; `timeout` is only the safety net of a broken server."""
    deadline = time.monotonic() + timeout
    while (done := scraped_value(server.http_port, TRIMMED)) is None or done < count:
        assert done is not None, "the server does not count large requests trimmed"
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{done} of {count} large requests trimmed:\n"
                               + "".join(server.lines[-30:]))


def growth_after(send: Callable[[], str], expected: str, server: ServerProcess) -> int:
    """RSS after REQUESTS more requests minus RSS after WARM_UP of them, each figure read
    once their memory was handed back."""
    for _ in range(WARM_UP):
        assert send() == expected
    wait_trimmed(server, WARM_UP)
    warm = rss_bytes(server.proc.pid)
    for _ in range(REQUESTS):
        assert send() == expected
    wait_trimmed(server, WARM_UP + REQUESTS)
    return rss_bytes(server.proc.pid) - warm


@pytest.fixture
def server(random_model: Path) -> Iterator[ServerProcess]:
    served = ServerProcess(server_args(random_model, "--http-port", str(free_port())))
    served.wait_serving()
    yield served
    served.kill()


def test_refused_large_grpc_requests_hand_their_memory_back(server: ServerProcess) -> None:
    """One text of 15 MB per Translate, refused (over the model's source length): grpc kept
    each request in a reference cycle (context.abort) and the allocator kept what was freed."""
    request = pb2.TranslateRequest(texts=["seven " * (MESSAGE_BYTES // 6)])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[
            ("grpc.max_send_message_length", request.ByteSize() + 1024)]) as channel:
        stub = pb2_grpc.TranslatorStub(channel)

        def send() -> str:
            try:
                stub.Translate(request, timeout=120)
            except grpc.RpcError as exc:
                return str(exc.code().name)
            return "OK"

        growth = growth_after(send, "INVALID_ARGUMENT", server)
    assert growth <= ALLOWED_MESSAGES * MESSAGE_BYTES, f"RSS grew by {growth >> 20} MiB"


def test_refused_large_http_bodies_hand_their_memory_back(server: ServerProcess) -> None:
    """15 MB bodies that are not JSON (cut short), refused with 400: the HTTP front end kept
    each body's error, whose traceback held the body, in a reference cycle."""
    body = json.dumps({"texts": ["seven " * (MESSAGE_BYTES // 6)]}).encode()[:-1]
    url = f"http://127.0.0.1:{server.http_port}/v1/translate"

    def send() -> str:
        request = urllib.request.Request(url, data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return str(response.status)
        except urllib.error.HTTPError as exc:
            exc.read()
            return str(exc.code)

    growth = growth_after(send, "400", server)
    assert growth <= ALLOWED_MESSAGES * MESSAGE_BYTES, f"RSS grew by {growth >> 20} MiB"


# -- FreedMemory, without a server ----------------------------------------------------------


def trimmed_count(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value(TRIMMED) or 0.0


def test_freed_memory_trims_once_the_large_requests_in_flight_have_ended() -> None:
    """Without an event loop the trim runs at once (in the caller's thread)."""
    trims: list[int] = []
    metrics = Metrics()
    freed = FreedMemory(metrics, trim=lambda: trims.append(freed.in_flight))
    freed.started()
    freed.started()
    freed.ended()
    assert trims == []  # one is still in flight: its memory is in use
    freed.ended()
    assert trims == [0]
    freed.started()
    freed.ended()
    assert trims == [0, 0]
    assert trimmed_count(metrics) == 3
    assert LARGE_REQUEST_BYTES <= 15_000_000  # a request near --max-message-bytes is large


def test_freed_memory_runs_one_trim_at_a_time_and_covers_what_ended_meanwhile() -> None:
    """On an event loop the trim runs on a thread; requests that end while it runs are
    handed back by one more trim after it."""
    metrics = Metrics()
    running, release = threading.Event(), threading.Event()
    trims: list[str] = []

    def trim() -> None:  # the trim thread
        trims.append(threading.current_thread().name)
        running.set()
        release.wait(60)

    async def main() -> None:
        freed = FreedMemory(metrics, trim)
        freed.started()
        freed.ended()
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 60)
        for _ in range(2):  # they end while the first trim runs
            freed.started()
            freed.ended()
        assert len(trims) == 1 and trimmed_count(metrics) == 0
        release.set()
        while trimmed_count(metrics) < 3:
            await asyncio.sleep(0)
        assert len(trims) == 2

    asyncio.run(main())
    assert all(name.startswith("tfserve-trim") for name in trims)
