"""The server's entry point: `python -m tfserve serve --model DIR --port 50051 --http-port
8080` (docs/server.md).

Layers, each importing only the ones below it:

    tfserve.server.translator_server          (one process: the core and its front ends)
    tfserve.frontends.grpc_server / grpc_api  (gRPC: protobuf in/out, TLS, auth, health)
    tfserve.frontends.http_server / http_api  (HTTP/JSON and server-sent events, probes)
    -> tfserve.serving                        (checks, calls, each RPC's steps, lifecycle)
    -> tfserve.scheduler                    (queue, dynamic + continuous batching, worker)
    -> tfserve.runtime                      (the ONNX Runtime graphs)

`main` parses the settings and starts one server process, or `--workers N` of them
(tfserve.server.worker_processes); `run_server` builds the server (tracing set up first, then the
models
loaded) and serves until SIGTERM / SIGINT; `serve` is the same on a running event loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tfserve.argparsing import EXIT_USAGE
from tfserve.server.translator_server import TranslatorServer
from tfserve.serving.process_tuning import event_loop_runner, keep_freed_memory
from tfserve.serving.settings import ServerConfig, parse_config
from tfserve.telemetry.logs import setup_logging

log = logging.getLogger("tfserve.server")


async def serve(config: ServerConfig, runtime: Any | None = None, worker: int | None = None,
                on_serving: Callable[[], None] | None = None,
                server: TranslatorServer | None = None) -> int:
    """Run until SIGTERM / SIGINT, then drain; returns the exit code. on_serving is called
    once the server listens (a worker tells its parent that it started); `server`: one
    already built (else it is built here, with `runtime` as its model when given)."""
    if server is None:
        server = TranslatorServer(config, runtime, worker=worker)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before start: a signal then still drains
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    if on_serving is not None:
        on_serving()
    await stop.wait()
    drain = asyncio.ensure_future(server.drain())
    # a second signal during the drain stops at once
    stop.clear()
    forced = asyncio.ensure_future(stop.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.warning("second signal: stopping without waiting for requests in flight")
        drain.cancel()
        await server.stop_now()
    forced.cancel()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tfserve serve ...`; returns the exit code."""
    config = parse_config(argv)
    setup_logging(config.log_format, config.log_level)
    if config.workers > 1:
        from tfserve.server.worker_processes import run_workers

        return run_workers(config)
    return run_server(config)


def run_server(config: ServerConfig, worker: int | None = None,
               on_serving: Callable[[], None] | None = None) -> int:
    """Load the models and serve in this process until stopped; returns the exit code."""
    keep_freed_memory()
    try:
        run = event_loop_runner(config.event_loop)
        # before any event loop runs: tracing checked, then the models loaded (--load eager)
        server = TranslatorServer(config, worker=worker)
        return run(serve(config, worker=worker, on_serving=on_serving, server=server))
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
