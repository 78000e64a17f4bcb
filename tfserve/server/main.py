"""The server's entry point: `python -m tfserve serve --model DIR --port 50051 --http-port
8080` (docs/server.md).

Layers, each importing only the ones below it:

    tfserve.server.main / worker_processes    (the entry point; --workers N processes)
    tfserve.server.translator_server          (one process: the core and its front ends)
    tfserve.frontends.grpc_server / grpc_api  (gRPC: protobuf in/out, TLS, auth, health)
    tfserve.frontends.http_server / http_api  (HTTP/JSON and server-sent events, probes)
    -> tfserve.serving                        (checks, calls, each RPC's steps, lifecycle)
    -> tfserve.scheduler                      (queue, dynamic + continuous batching, worker)
    -> tfserve.runtime                        (the ONNX Runtime graphs)

`main` parses the settings and starts one server process (translator_server.run_server), or
`--workers N` of them (tfserve.server.worker_processes).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tfserve.server.translator_server import run_server
from tfserve.serving.settings import parse_config
from tfserve.telemetry.logs import setup_logging


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tfserve serve ...`; returns the exit code."""
    config = parse_config(argv)
    setup_logging(config.log_format, config.log_level)
    if config.workers > 1:
        from tfserve.server.worker_processes import run_workers

        return run_workers(config)
    return run_server(config)


if __name__ == "__main__":
    sys.exit(main())
