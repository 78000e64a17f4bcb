"""Load generator for a running server: throughput and latency at several concurrencies.

    python -m tfserve.bench.loadgen --server localhost:50051
    python -m tfserve.bench.loadgen --server localhost:50051 --concurrency 1,8,32,64 \
        --requests 400 --duration 20 --max-new-tokens 32 --json
    python -m tfserve.bench.loadgen --server localhost:50051 --http localhost:8080

For each concurrency level, that many closed-loop clients (each sends its next request when
the previous answer arrives) run in --processes worker processes (blocking gRPC stubs, one
thread per client, one channel per process unless --connections asks for more: a server
with --workers spreads connections over its workers); a level ends after --requests requests or
--duration seconds, whichever comes first. Reported per level: texts/s, generated tokens/s
(tokens of the best hypotheses), p50 / p99 request latency, and the load generator's own CPU
time per request (all its processes). With --server-pid (a server on this machine), the
server's CPU time per request too: on a shared machine, the two add up to what the cores
spent per request. Sources are English number phrases (the demo's domain) unless
--texts-file gives one text per line. Every request carries one text unless
--texts-per-request says otherwise.

With --offline DIR (the artifacts the server serves) and --threads N (the server's), the same
texts are first translated in-process by the offline runtime: at batch 32 (throughput) and one
at a time (latency); then the served figures are printed as ratios of the offline ones
(throughput at 32 clients / offline batch-32 throughput, p50 at 1 client / offline p50).
On a machine whose speed drifts (shared cores), --rounds N then measures the 32-client level
N more times, each between two offline batch-32 measurements, and prints each round's ratio
to the mean of the two around it, and their median.

With --rpc health, the clients send grpc.health.v1 Health.Check instead of Translate: the
cheapest call the server answers, through the same gRPC stack, event loop and interceptors.
Its latency and CPU time per request are the floor under any Translate figure on the same
machine (what the transport, both Pythons and the cores' sharing cost with no model at all).

With --rpc encode, the clients send Encode (sentence embeddings: an encoder-only model's
only call); texts/s counts the embedded texts and tokens/s their source tokens.

With --http HOST:PORT (the server's --http-port), every level also runs over the HTTP API
(POST /v1/translate, POST /v1/encode for --rpc encode, or GET /healthz for --rpc health)
with aiohttp clients: the same client count, texts, options and seeds, one connection per
client (HTTP/1.1 carries one call at a time); the two transports' rows come side by side.
--transports picks them (default: grpc, and http when --http is given).

With --model-name NAME, the requests name that model of a `--model-repository` server (the
--offline figures are still those of DIR).

Only loopback targets are accepted unless --allow-remote: this is a benchmark, not a way to
load someone else's server.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.bench.closed_loop import LevelResult, run_level
from tfserve.bench.common import cpu_seconds, percentile_ms

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
         "fourteen fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def english_number(n: int) -> str:
    """English words for 0 <= n < 1,000,000 ("three hundred and forty-two")."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + english_number(rest))
    rest = n % 1000
    head = english_number(n // 1000) + " thousand"
    if rest == 0:
        return head
    return head + (" and " if rest < 100 else " ") + english_number(rest)


def number_phrases(count: int, seed: int = 0) -> list[str]:
    """`count` English number phrases, as many below 100 as below 1,000 and up to 999,999."""
    rng = random.Random(seed)
    return [english_number(rng.choice((rng.randint(0, 99), rng.randint(100, 999),
                                       rng.randint(1000, 999_999)))) for _ in range(count)]


def is_loopback(target: str) -> bool:
    """Whether HOST:PORT (or a unix: socket) names this machine only: every address the host
    resolves to is a loopback address."""
    host = target.rsplit(":", 1)[0].strip("[]") if ":" in target else target
    if host.startswith(("unix:", "unix-abstract:")):
        return True
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def build_parser() -> argparse.ArgumentParser:
    """The load generator's flags."""
    parser = argparse.ArgumentParser(prog="python -m tfserve.bench.loadgen",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--http", default=None, metavar="HOST:PORT",
                        help="the server's HTTP API (--http-port): measure it too")
    parser.add_argument("--transports", default=None,
                        help="comma-separated: grpc, http (default: grpc, plus http with "
                             "--http)")
    parser.add_argument("--concurrency", default="1,8,32,64",
                        help="comma-separated client counts, one run each")
    parser.add_argument("--requests", type=int, default=200, help="requests per level (max)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per level (max)")
    parser.add_argument("--rpc", choices=("translate", "encode", "health"), default="translate",
                        help="encode: Encode calls (sentence embeddings); health: "
                             "Health.Check calls, the floor under Translate's figures")
    parser.add_argument("--texts-per-request", type=int, default=1)
    parser.add_argument("--texts-file", type=Path, default=None,
                        help="source texts, one per line (default: English number phrases)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the server default")
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--model-name", default="",
                        help="the model of a --model-repository server to send to (default: "
                             "the server's default model)")
    parser.add_argument("--warmup", type=int, default=4, help="requests sent before measuring")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request deadline (s)")
    parser.add_argument("--token", default=None, help="bearer token, when the server wants one")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a target that is not a loopback address")
    parser.add_argument("--json", action="store_true", help="one JSON object per level")
    parser.add_argument("--offline", type=Path, default=None, metavar="DIR",
                        help="also measure these artifacts offline and print served/offline")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads for --offline (use the server's)")
    parser.add_argument("--processes", type=int, default=0,
                        help="load generator processes (0: one per core, at most one per "
                             "client)")
    parser.add_argument("--connections", type=int, default=0,
                        help="TCP connections in all, at most one per client (0: one per "
                             "process); a server with --workers balances connections")
    parser.add_argument("--rounds", type=int, default=0,
                        help="with --offline: 32-client runs, each between two offline "
                             "batch-32 runs, for a drift-resistant median ratio (0: none)")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="the server's process id (same machine): also print its CPU "
                             "time per request")
    return parser


def offline_translator(artifacts: Path, threads: int) -> Any:
    """The in-process reference: a `Translator` on the served artifacts, batches of 32."""
    from tfserve.translator import Translator

    return Translator(artifacts, intra_op_threads=threads, max_batch_size=32)


def offline_throughput(translator: Any, texts: list[str], options: dict[str, Any],
                       count: int = 256, call_texts: int | None = None
                       ) -> tuple[float, float, float]:
    """Offline (tokens/s, texts/s, CPU ms per text) at batch 32 over the first `count` texts:
    all of them in one call (the translator sorts them by length before it cuts batches of 32),
    or, with `call_texts`, in calls of that many texts in their given order. The CPU time is
    this process's, every thread (ONNX Runtime's pool included)."""
    sample = texts[:count]
    translator.translate_hypotheses(sample[:32], **options)  # warm-up
    step = call_texts or len(sample)
    cpu_before, started = cpu_seconds(), time.perf_counter()
    hyps = [h for start in range(0, len(sample), step)
            for h in translator.translate_hypotheses(sample[start:start + step], **options)]
    seconds = time.perf_counter() - started
    cpu_ms = (cpu_seconds() - cpu_before) / len(sample) * 1000.0
    return sum(len(h[0].token_ids) for h in hyps) / seconds, len(sample) / seconds, cpu_ms


def offline_figures(translator: Any, texts: list[str], options: dict[str, Any],
                    count: int = 256) -> dict[str, float]:
    """Offline tokens/s at batch 32 (sorted over `count` texts, and in calls of 32 texts in
    arrival order: what a caller gets without seeing more than one batch ahead) and p50
    latency of single texts, same texts and options; and the CPU time a text costs at batch 32
    (sorted), the least any server spends on it."""
    sample = texts[:count]
    tokens_per_s, texts_per_s, cpu_ms = offline_throughput(translator, texts, options, count)
    calls_tokens_per_s, _, _ = offline_throughput(translator, texts, options, count, 32)
    single = []
    for text in sample[:64]:
        started = time.perf_counter()
        translator.translate_hypotheses([text], **options)
        single.append(time.perf_counter() - started)
    return {"batch32_tokens_per_s": round(tokens_per_s, 1),
            "batch32_texts_per_s": round(texts_per_s, 2),
            "batch32_cpu_ms_per_text": round(cpu_ms, 3),
            "calls32_tokens_per_s": round(calls_tokens_per_s, 1),
            "single_p50_ms": percentile_ms(single, 50)}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit code (1 when any request failed, 2 on bad flags)."""
    args = build_parser().parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        print(f"loadgen: error: --concurrency must be integers, got {args.concurrency!r}",
              file=sys.stderr)
        return 2
    if not levels or min(levels) < 1 or args.requests < 1 or args.duration <= 0:
        print("loadgen: error: --concurrency, --requests and --duration must be positive",
              file=sys.stderr)
        return 2
    if args.connections < 0 or args.processes < 0:
        print("loadgen: error: --connections and --processes must be >= 0", file=sys.stderr)
        return 2
    if args.rounds and args.offline is None:
        print("loadgen: error: --rounds needs --offline (each round is a served run between "
              "two offline runs)", file=sys.stderr)
        return 2
    if args.rpc != "translate" and (args.num_beams != 1 or args.max_new_tokens):
        print(f"loadgen: error: --num-beams and --max-new-tokens are decoding options; --rpc "
              f"{args.rpc} takes neither", file=sys.stderr)
        return 2
    if args.rpc != "translate" and (args.offline is not None or args.rounds):
        print(f"loadgen: error: --offline and --rounds compare translations; --rpc {args.rpc} "
              "takes neither", file=sys.stderr)
        return 2
    transports = [t.strip() for t in (args.transports or (
        "grpc,http" if args.http else "grpc")).split(",") if t.strip()]
    if not transports or set(transports) - {"grpc", "http"} or len(set(transports)) < len(
            transports):
        print(f"loadgen: error: --transports takes grpc and/or http, got {args.transports!r}",
              file=sys.stderr)
        return 2
    if "http" in transports and not args.http:
        print("loadgen: error: the http transport needs --http HOST:PORT (the server's "
              "--http-port)", file=sys.stderr)
        return 2
    targets = {"grpc": args.server, "http": args.http}
    for transport in transports:
        if not args.allow_remote and not is_loopback(targets[transport]):
            print(f"loadgen: error: {targets[transport]} is not a loopback address "
                  "(--allow-remote)", file=sys.stderr)
            return 2
    if args.texts_file is not None:
        texts = [line.strip() for line in args.texts_file.read_text().splitlines()
                 if line.strip()]
    else:
        texts = number_phrases(1000)
    options: dict[str, Any] = {"num_beams": args.num_beams}
    if args.max_new_tokens:
        options["max_new_tokens"] = args.max_new_tokens

    offline = translator = None
    if args.offline is not None:
        translator = offline_translator(args.offline, args.threads)
        offline = offline_figures(translator, texts, options)

    served = {**options, "model": args.model_name} if args.model_name else options

    def level(concurrency: int, requests: int, transport: str = transports[0]) -> LevelResult:
        return run_level(targets[transport], concurrency, requests, args.duration, texts,
                         args.texts_per_request, served, args.token, args.timeout,
                         args.processes, args.server_pid, args.rpc, args.connections,
                         transport)

    if args.warmup:
        for transport in transports:
            level(1, args.warmup, transport)
    # the transports of one level side by side, level after level
    results = [level(concurrency, args.requests, transport)
               for concurrency in levels for transport in transports]
    if args.json:
        for result in results:
            print(json.dumps(asdict(result)))
    else:
        server_column = args.server_pid is not None
        print(f"{'transport':>9} {'clients':>7} {'requests':>8} {'errors':>6} {'req/s':>8} "
              f"{'texts/s':>9} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'client CPU ms/req':>17}"
              + (f" {'server CPU ms/req':>17}" if server_column else ""))
        for r in results:
            print(f"{r.transport:>9} {r.concurrency:>7} {r.requests:>8} {r.errors:>6} "
                  f"{r.requests_per_s:>8.1f} {r.texts_per_s:>9.1f} {r.tokens_per_s:>9.1f} "
                  f"{r.p50_ms:>8.1f} {r.p99_ms:>8.1f} {r.client_cpu_ms_per_request:>17.2f}"
                  + (f" {r.server_cpu_ms_per_request or float('nan'):>17.2f}"
                     if server_column else ""))
        for r in results:
            if r.error_codes:
                print(f"errors at {r.concurrency} clients ({r.transport}): {r.error_codes}")
    if offline is not None:
        ratios: dict[str, Any] = {"offline": offline}
        for transport in transports:
            # the first transport's keys carry no prefix, the others' their name
            prefix = "" if transport == transports[0] else f"{transport}_"
            by_level = {r.concurrency: r for r in results if r.transport == transport}
            if 32 in by_level:
                ratios[f"{prefix}throughput_32_clients_vs_offline_batch32"] = round(
                    by_level[32].tokens_per_s / offline["batch32_tokens_per_s"], 3)
                ratios[f"{prefix}throughput_32_clients_vs_offline_calls_of_32"] = round(
                    by_level[32].tokens_per_s / offline["calls32_tokens_per_s"], 3)
            if 1 in by_level:
                ratios[f"{prefix}p50_1_client_vs_offline_single"] = round(
                    by_level[1].p50_ms / offline["single_p50_ms"], 3)
        print(json.dumps(ratios) if args.json else
              f"offline: {offline}\nserved / offline: "
              f"{ {k: v for k, v in ratios.items() if k != 'offline'} }")
    if translator is not None and args.rounds > 0:
        rounds = drift_rounds(args.rounds, lambda: level(32, args.requests).tokens_per_s,
                              lambda: offline_throughput(translator, texts, options)[0])
        print(json.dumps(rounds) if args.json else
              f"rounds (32 clients / mean of the offline runs around): {rounds['ratios']}, "
              f"median {rounds['median_ratio']}")
    return 1 if any(r.errors for r in results) else 0


def drift_rounds(count: int, served: Callable[[], float],
                 offline: Callable[[], float]) -> dict[str, Any]:
    """`count` served measurements, each between two offline ones: offline, served, offline,
    served, ..., offline. Returns the served and offline figures, each round's ratio of
    served to the mean of the offline figures around it, and their median."""
    offline_runs, served_runs = [offline()], []
    for _ in range(count):
        served_runs.append(served())
        offline_runs.append(offline())
    ratios = [round(s / ((a + b) / 2.0), 3)
              for s, a, b in zip(served_runs, offline_runs, offline_runs[1:])]
    return {"served_tokens_per_s": [round(s, 1) for s in served_runs],
            "offline_tokens_per_s": [round(o, 1) for o in offline_runs],
            "ratios": ratios, "median_ratio": round(float(np.median(ratios)), 3)}


if __name__ == "__main__":
    sys.exit(main())
