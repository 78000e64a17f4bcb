"""A server's resident memory under large refused requests: one client sending Translate
requests of about --message-bytes each, one after another, for --duration seconds.

    python -m tfserve.bench.large_requests [--model DIR] [--transport grpc|http] \\
        [--message-bytes 15000000] [--shape one|many] [--duration 60] [--json]

It starts `python -m tfserve serve` (the bundled demo unless --model; metrics on the HTTP
port), answers one small request, and reads the server's VmRSS: the idle figure. Then the
client sends the requests: `one` text of --message-bytes characters, or `many` texts (256 of
them) of that size together; either way every text is over the model's limit, so each
request is refused with INVALID_ARGUMENT (HTTP 400) after the server received and parsed it.
After the last answer, it waits until the server says it handed the memory of every request
back (tfserve_large_requests_trimmed_total reaches the requests sent), when the server has
that metric, and reads VmRSS again: the figure after the traffic. Also reported: the largest
VmRSS read after an answer, the peak (VmHWM), and the growth in messages (MiB over
--message-bytes).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tfserve.bench.common import proc_status_kib, scraped_value, stop_process

MANY_TEXTS = 256  # the `many` shape: as many texts as a request may hold by default


@dataclass
class Figures:
    """One run's figures (memory in MiB)."""

    transport: str
    shape: str
    message_bytes: int
    duration_s: float
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    idle_rss_mib: float = 0.0
    max_rss_mib: float = 0.0  # the largest VmRSS read after an answer
    after_rss_mib: float = 0.0  # once the memory of the last request was handed back
    peak_rss_mib: float = 0.0  # VmHWM
    growth_messages: float = 0.0  # (after - idle) / message size
    trims_awaited: bool = False  # whether the server counted them all trimmed (its metric)


def status_mib(pid: int, key: str) -> float:
    """A VmRSS / VmHWM line of /proc/PID/status, in MiB (Linux)."""
    return round(proc_status_kib(pid, key) / 1024, 1)


def texts_of(shape: str, message_bytes: int) -> list[str]:
    """The request's texts: about message_bytes characters in all, every text over any
    model's character limit."""
    word = "seven "
    if shape == "one":
        return [word * (message_bytes // len(word))]
    return [word * (message_bytes // len(word) // MANY_TEXTS)] * MANY_TEXTS


class Server:
    """`python -m tfserve serve` on free ports (gRPC and HTTP), its log read for the gRPC
    port."""

    def __init__(self, model: Path | None, extra: Sequence[str]) -> None:
        flags = ["--model", str(model)] if model is not None else []
        with socket.socket() as sock:  # --http-port 0 turns HTTP off: a free port instead
            sock.bind(("127.0.0.1", 0))
            http_port = sock.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tfserve", "serve", *flags, "--host", "127.0.0.1",
             "--port", "0", "--http-port", str(http_port), "--metrics-port", "0",
             "--log-format", "json",
             "--log-level", "info", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.process.stderr is not None
        for line in self.process.stderr:  # the demo may export itself first
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "serving":
                self.port, self.http_port = int(record["port"]), int(record["http_port"])
                break
        else:
            raise RuntimeError(f"the server exited (code {self.process.wait()})")
        # the rest of its log (an access record per request) is read and dropped, so that
        # the pipe never fills up and blocks the server
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def trimmed(self) -> float | None:
        """tfserve_large_requests_trimmed_total from GET /metrics; None without it."""
        return scraped_value(self.http_port, "tfserve_large_requests_trimmed_total")

    def stop(self) -> None:
        stop_process(self.process)


class GrpcSender:
    """Translate over gRPC; send() returns the status code's name."""

    def __init__(self, port: int, texts: list[str]) -> None:
        import grpc

        from tfserve.proto import translator_pb2 as pb2
        from tfserve.proto import translator_pb2_grpc as pb2_grpc

        self.grpc = grpc
        self.request = pb2.TranslateRequest(texts=texts)
        size = self.request.ByteSize()
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", size + 1024)])
        self.stub = pb2_grpc.TranslatorStub(self.channel)

    def send(self) -> str:
        try:
            self.stub.Translate(self.request, timeout=600)
        except self.grpc.RpcError as exc:
            return str(exc.code().name)
        return "OK"

    def close(self) -> None:
        self.channel.close()


class HttpSender:
    """POST /v1/translate; send() returns the HTTP status."""

    def __init__(self, port: int, texts: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/translate"
        self.body = json.dumps({"texts": texts}).encode()

    def send(self) -> str:
        request = urllib.request.Request(self.url, data=self.body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()
                return str(response.status)
        except urllib.error.HTTPError as exc:
            exc.read()
            return str(exc.code)

    def close(self) -> None:
        pass


def measure(args: argparse.Namespace) -> Figures:
    figures = Figures(args.transport, args.shape, args.message_bytes, args.duration)
    server = Server(args.model, args.server_flag)
    try:
        from tfserve.client import Client

        with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
            client.translate(["seven"])
        figures.idle_rss_mib = status_mib(server.pid, "VmRSS")
        texts = texts_of(args.shape, args.message_bytes)
        sender = (GrpcSender(server.port, texts) if args.transport == "grpc"
                  else HttpSender(server.http_port, texts))
        statuses: Counter[str] = Counter()
        started = time.monotonic()
        try:
            while time.monotonic() - started < args.duration:
                statuses[sender.send()] += 1
                figures.max_rss_mib = max(figures.max_rss_mib,
                                          status_mib(server.pid, "VmRSS"))
        finally:
            sender.close()
        figures.requests = sum(statuses.values())
        figures.statuses = dict(statuses)
        # a minute at most: a request under the server's large size is not counted
        trimmed = server.trimmed()
        figures.trims_awaited = trimmed is not None
        waited = time.monotonic()
        while trimmed is not None and trimmed < figures.requests:
            if time.monotonic() - waited > 60:
                figures.trims_awaited = False
                break
            trimmed = server.trimmed()
        figures.after_rss_mib = status_mib(server.pid, "VmRSS")
        figures.peak_rss_mib = status_mib(server.pid, "VmHWM")
        figures.growth_messages = round(
            (figures.after_rss_mib - figures.idle_rss_mib) * 2**20 / args.message_bytes, 2)
    finally:
        server.stop()
    return figures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tfserve.bench.large_requests",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="artifacts directory (default: the bundled demo)")
    parser.add_argument("--transport", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--message-bytes", type=int, default=15_000_000,
                        help="characters of text per request (under the server's "
                             "--max-message-bytes, 16 MiB by default)")
    parser.add_argument("--shape", choices=("one", "many"), default="one",
                        help=f"one text, or {MANY_TEXTS} texts, of --message-bytes in all")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of traffic")
    parser.add_argument("--server-flag", action="append", default=[],
                        help="a flag for the server, repeated for each (--server-flag=--threads "
                             "--server-flag=1)")
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    figures = measure(args)
    if args.json:
        print(json.dumps(asdict(figures)))
    else:
        print(f"{figures.transport}, {figures.shape} text(s), {figures.message_bytes} bytes, "
              f"{figures.duration_s:.0f} s: {figures.requests} requests {figures.statuses}")
        print(f"RSS idle {figures.idle_rss_mib} MiB, largest after an answer "
              f"{figures.max_rss_mib} MiB, after {figures.after_rss_mib} MiB "
              f"({figures.growth_messages:+} messages), peak {figures.peak_rss_mib} MiB"
              + ("" if figures.trims_awaited else " (read at once: the server did not count "
                 "them trimmed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
