"""What the Open Inference Protocol front end costs: one server, the same model and texts,
closed-loop load through tfserve's own client (tfserve.v1.Translator over gRPC) and through
tritonclient's asyncio clients (inference.GRPCInferenceService over gRPC, and the REST API).

    python -m tfserve.bench.oip_load [--model DIR] [--concurrency 16] [--requests 400] \\
        [--texts-per-request 1] [--max-new-tokens 32] [--threads 2] [--rounds 3] [--json]

It starts `python -m tfserve serve --model DIR` (default: the bundled demo, exported on first
use) with gRPC and HTTP on loopback ports, then runs each transport in turn, --rounds times
(each round in another order, so that a machine whose speed drifts favours none): --concurrency
clients on one event loop, each sending its next request when the last one's answer is in,
until --requests requests have been answered. Texts are English number phrases (the demo's
domain), the same ones in the same order for every transport. Reported per transport: texts/s
and generated tokens/s (the server's tfserve_generated_tokens_total over the run, so every
transport is counted alike), p50 / p99 request latency; then each protocol transport's
throughput as a ratio to the native one's (the median over the rounds).

Everything runs on this machine: the clients share its cores with the server, and a client
that costs more CPU per request (building and reading tensors) shows in the figures, as it
would on any machine where clients and server share cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tfserve.bench.common import percentile_ms, scraped_value
from tfserve.bench.loadgen import number_phrases
from tfserve.bench.multi_model import Server

TRANSPORTS = ("native-grpc", "oip-grpc", "oip-http")  # tfserve.v1 over gRPC; the protocol's
TOKENS = "tfserve_generated_tokens_total"

Send = Callable[[list[str]], Awaitable[None]]


@dataclass
class Run:
    """One transport's figures in one round."""

    transport: str
    round: int
    requests: int
    seconds: float
    texts_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float


async def closed_loop(send: Send, batches: list[list[str]], concurrency: int
                      ) -> list[float]:
    """Send every batch, `concurrency` at a time (each client takes the next batch when its
    answer is in); the latencies in seconds."""
    latencies: list[float] = []
    pending = iter(batches)

    async def client() -> None:
        for texts in pending:
            started = time.perf_counter()
            await send(texts)
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def native_sender(target: str, model: str, options: dict[str, Any]
                  ) -> tuple[Send, Callable[[], Any]]:
    """tfserve's AsyncClient: Translate."""
    from tfserve.client import AsyncClient

    client = AsyncClient(target, timeout=300)

    async def send(texts: list[str]) -> None:
        await client.translate(texts, model=model, **options)

    return send, client.close


def oip_grpc_sender(target: str, model: str, options: dict[str, Any]
                    ) -> tuple[Send, Callable[[], Any]]:
    """tritonclient.grpc.aio: ModelInfer."""
    import numpy as np
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(target)
    wanted = [grpcclient.InferRequestedOutput("translation")]

    async def send(texts: list[str]) -> None:
        tensor = grpcclient.InferInput("text", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
        result = await client.infer(model, [tensor], outputs=wanted, parameters=options)
        assert len(result.as_numpy("translation")) == len(texts)

    return send, client.close


def oip_http_sender(target: str, model: str, options: dict[str, Any]
                    ) -> tuple[Send, Callable[[], Any]]:
    """tritonclient.http.aio: POST /v2/models/{model}/infer, binary tensor data."""
    import numpy as np
    import tritonclient.http.aio as httpclient

    client = httpclient.InferenceServerClient(target)
    wanted = [httpclient.InferRequestedOutput("translation", binary_data=True)]

    async def send(texts: list[str]) -> None:
        tensor = httpclient.InferInput("text", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
        result = await client.infer(model, [tensor], outputs=wanted, parameters=options)
        assert len(result.as_numpy("translation")) == len(texts)

    return send, client.close


SENDERS = {"native-grpc": native_sender, "oip-grpc": oip_grpc_sender,
           "oip-http": oip_http_sender}


async def measure(transport: str, server: Server, model: str, batches: list[list[str]],
                  concurrency: int, options: dict[str, Any], round_index: int) -> Run:
    """One transport's run: every batch through it, timed, the tokens counted by the server."""
    target = f"127.0.0.1:{server.http_port}" if transport == "oip-http" else server.target
    send, close = SENDERS[transport](target, model, options)
    try:
        await send(batches[0])  # connected and warm before the clock starts
        tokens = scraped_value(server.http_port, TOKENS) or 0.0
        started = time.perf_counter()
        latencies = await closed_loop(send, batches, concurrency)
        seconds = time.perf_counter() - started
        generated = (scraped_value(server.http_port, TOKENS) or 0.0) - tokens
    finally:
        await close()
    texts = sum(len(batch) for batch in batches)
    return Run(transport, round_index, len(batches), seconds, texts / seconds,
               generated / seconds, percentile_ms(latencies, 50), percentile_ms(latencies, 99))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tfserve.bench.oip_load",
        description="Throughput of the Open Inference Protocol front end (tritonclient's "
                    "asyncio gRPC and HTTP clients) against the native gRPC API (tfserve's "
                    "client) on one server, model and set of texts.")
    parser.add_argument("--model", type=Path, default=None,
                        help="artifacts directory to serve (default: the bundled demo)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="closed-loop clients per transport (default: 16)")
    parser.add_argument("--requests", type=int, default=400,
                        help="requests per transport and round (default: 400)")
    parser.add_argument("--texts-per-request", type=int, default=1,
                        help="texts in each request (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="max_new_tokens of every request (default: 32)")
    parser.add_argument("--threads", type=int, default=2,
                        help="the server's ONNX Runtime threads (default: 2)")
    parser.add_argument("--max-batch-size", type=int, default=32,
                        help="the server's --max-batch-size (default: 32)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every transport, each in another order (default: 3)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help=f"comma-separated, of {', '.join(TRANSPORTS)} (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the texts' seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="one JSON line per run")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The transports to run; a parser error naming the flag for a bad value."""
    for flag in ("concurrency", "requests", "texts_per_request", "max_new_tokens", "threads",
                 "max_batch_size", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, "
                         f"got {getattr(args, flag)}")
    transports = [name.strip() for name in args.transports.split(",") if name.strip()]
    unknown = [name for name in transports if name not in TRANSPORTS]
    if unknown or not transports:
        parser.error(f"--transports takes {', '.join(TRANSPORTS)}, got {args.transports!r}")
    return transports


def ratios(runs: Sequence[Run]) -> dict[str, float]:
    """Each protocol transport's tokens/s over the native one's, round by round; the
    median of each."""
    native = {run.round: run.tokens_per_s for run in runs if run.transport == "native-grpc"}
    found: dict[str, list[float]] = {}
    for run in runs:
        if run.transport != "native-grpc" and native.get(run.round):
            found.setdefault(run.transport, []).append(run.tokens_per_s / native[run.round])
    return {name: statistics.median(values) for name, values in found.items()}


async def run_all(args: argparse.Namespace, transports: list[str], server: Server
                  ) -> list[Run]:
    texts = number_phrases(args.requests * args.texts_per_request, args.seed)
    batches = [texts[index:index + args.texts_per_request]
               for index in range(0, len(texts), args.texts_per_request)]
    options = {"max_new_tokens": args.max_new_tokens}
    runs = []
    for round_index in range(args.rounds):
        shift = round_index % len(transports)
        for transport in transports[shift:] + transports[:shift]:
            run = await measure(transport, server, args.model.resolve().name, batches,
                                args.concurrency, options, round_index)
            runs.append(run)
            print(json.dumps(asdict(run)) if args.json else
                  f"round {run.round}  {run.transport:12} {run.texts_per_s:8.1f} texts/s "
                  f"{run.tokens_per_s:9.1f} tokens/s  p50 {run.p50_ms:7.1f} ms  "
                  f"p99 {run.p99_ms:7.1f} ms", flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    transports = check_args(parser, args)
    if args.model is None:
        from tfserve.demo import default_artifacts

        args.model = Path(default_artifacts())
    server = Server(["--model", str(args.model), "--max-batch-size",
                     str(args.max_batch_size)], args.threads, http=True)
    try:
        server.wait_serving()
        runs = asyncio.run(run_all(args, transports, server))
    finally:
        server.stop()
    for name, ratio in ratios(runs).items():
        print(json.dumps({"transport": name, "tokens_per_s_vs_native": round(ratio, 3)})
              if args.json else f"{name}: {ratio:.3f} x the native API's tokens/s "
                                f"(median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
