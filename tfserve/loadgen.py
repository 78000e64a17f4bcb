"""Load generator for a running server: throughput and latency at several concurrencies.

    python -m tfserve.loadgen --server localhost:50051
    python -m tfserve.loadgen --server localhost:50051 --concurrency 1,8,32,64 \
        --requests 400 --duration 20 --max-new-tokens 32 --json

For each concurrency level, that many closed-loop clients (each sends its next request when
the previous answer arrives) share one channel; a level ends after --requests requests or
--duration seconds, whichever comes first. Reported per level: texts/s, generated tokens/s
(tokens of the best hypotheses), and p50 / p99 request latency. Sources are English number
phrases (the demo's domain) unless --texts-file gives one text per line.

With --offline DIR (the artifacts the server serves) and --threads N (the server's), the same
texts are first translated in-process by the offline runtime: at batch 32 (throughput) and one
at a time (latency); then the served figures are printed as ratios of the offline ones
(throughput at 32 clients / offline batch-32 throughput, p50 at 1 client / offline p50).

Only loopback targets are accepted unless --allow-remote: this is a benchmark, not a way to
load someone else's server.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.client import AsyncClient, ServerError

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
    rng = random.Random(seed)
    return [english_number(rng.choice((rng.randint(0, 99), rng.randint(100, 999),
                                       rng.randint(1000, 999_999)))) for _ in range(count)]


@dataclass
class LevelResult:
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


def is_loopback(target: str) -> bool:
    host = target.rsplit(":", 1)[0].strip("[]") if ":" in target else target
    if host.startswith(("unix:", "unix-abstract:")):
        return True
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


async def run_level(target: str, concurrency: int, requests: int, duration: float,
                    texts: Sequence[str], texts_per_request: int, options: dict[str, Any],
                    token: str | None = None, timeout: float = 60.0) -> LevelResult:
    """One closed-loop run with `concurrency` clients."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counters = {"sent": 0, "texts": 0, "tokens": 0}
    rng = random.Random(concurrency)
    async with AsyncClient(target, timeout=timeout, token=token) as client:
        started = time.perf_counter()
        stop_at = started + duration

        async def worker() -> None:
            while counters["sent"] < requests and time.perf_counter() < stop_at:
                counters["sent"] += 1
                batch = [rng.choice(texts) for _ in range(texts_per_request)]
                sent = time.perf_counter()
                try:
                    hypotheses = await client.translate_hypotheses(batch, **options)
                except ServerError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    continue
                latencies.append(time.perf_counter() - sent)
                counters["texts"] += len(batch)
                counters["tokens"] += sum(len(h[0].token_ids) for h in hypotheses)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    lat_ms = np.array(latencies) * 1000.0
    return LevelResult(
        concurrency=concurrency, requests=len(latencies) + sum(errors.values()),
        errors=sum(errors.values()), texts=counters["texts"], tokens=counters["tokens"],
        seconds=round(seconds, 3), texts_per_s=round(counters["texts"] / seconds, 2),
        tokens_per_s=round(counters["tokens"] / seconds, 1),
        p50_ms=round(float(np.percentile(lat_ms, 50)), 2) if len(lat_ms) else float("nan"),
        p99_ms=round(float(np.percentile(lat_ms, 99)), 2) if len(lat_ms) else float("nan"),
        error_codes=errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tfserve.loadgen",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--concurrency", default="1,8,32,64",
                        help="comma-separated client counts, one run each")
    parser.add_argument("--requests", type=int, default=200, help="requests per level (max)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per level (max)")
    parser.add_argument("--texts-per-request", type=int, default=1)
    parser.add_argument("--texts-file", type=Path, default=None,
                        help="source texts, one per line (default: English number phrases)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the server default")
    parser.add_argument("--num-beams", type=int, default=1)
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
    return parser


def offline_figures(artifacts: Path, threads: int, texts: list[str], options: dict[str, Any],
                    count: int = 256) -> dict[str, float]:
    """Offline tokens/s at batch 32 and p50 latency of single texts, same texts and options."""
    from tfserve.translator import Translator

    translator = Translator(artifacts, intra_op_threads=threads, max_batch_size=32)
    sample = texts[:count]
    translator.translate_hypotheses(sample[:32], **options)  # warm-up
    started = time.perf_counter()
    hyps = translator.translate_hypotheses(sample, **options)
    seconds = time.perf_counter() - started
    tokens = sum(len(h[0].token_ids) for h in hyps)
    single = []
    for text in sample[:64]:
        started = time.perf_counter()
        translator.translate_hypotheses([text], **options)
        single.append(time.perf_counter() - started)
    return {"batch32_tokens_per_s": round(tokens / seconds, 1),
            "batch32_texts_per_s": round(len(sample) / seconds, 2),
            "single_p50_ms": round(float(np.percentile(np.array(single) * 1000.0, 50)), 2)}


def main(argv: Sequence[str] | None = None) -> int:
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
    if not args.allow_remote and not is_loopback(args.server):
        print(f"loadgen: error: {args.server} is not a loopback address (--allow-remote)",
              file=sys.stderr)
        return 2
    if args.texts_file is not None:
        texts = [line.strip() for line in args.texts_file.read_text().splitlines()
                 if line.strip()]
    else:
        texts = number_phrases(1000)
    options: dict[str, Any] = {"num_beams": args.num_beams}
    if args.max_new_tokens:
        options["max_new_tokens"] = args.max_new_tokens

    offline = None
    if args.offline is not None:
        offline = offline_figures(args.offline, args.threads, texts, options)

    async def run() -> list[LevelResult]:
        if args.warmup:
            await run_level(args.server, 1, args.warmup, args.duration, texts,
                            args.texts_per_request, options, args.token, args.timeout)
        return [await run_level(args.server, level, args.requests, args.duration, texts,
                                args.texts_per_request, options, args.token, args.timeout)
                for level in levels]

    try:
        results = asyncio.run(run())
    except ServerError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for result in results:
            print(json.dumps(asdict(result)))
    else:
        print(f"{'clients':>7} {'requests':>8} {'errors':>6} {'texts/s':>9} {'tokens/s':>9} "
              f"{'p50 ms':>8} {'p99 ms':>8}")
        for r in results:
            print(f"{r.concurrency:>7} {r.requests:>8} {r.errors:>6} {r.texts_per_s:>9.1f} "
                  f"{r.tokens_per_s:>9.1f} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f}")
    if offline is not None:
        by_level = {r.concurrency: r for r in results}
        ratios: dict[str, Any] = {"offline": offline}
        if 32 in by_level:
            ratios["throughput_32_clients_vs_offline_batch32"] = round(
                by_level[32].tokens_per_s / offline["batch32_tokens_per_s"], 3)
        if 1 in by_level:
            ratios["p50_1_client_vs_offline_single"] = round(
                by_level[1].p50_ms / offline["single_p50_ms"], 3)
        print(json.dumps(ratios) if args.json else
              f"offline: {offline}\nserved / offline: "
              f"{ {k: v for k, v in ratios.items() if k != 'offline'} }")
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
