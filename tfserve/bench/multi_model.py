"""One server with a model repository against one server per model: memory, and the latency
of a lone request to an idle model while other models are saturated.

    python -m tfserve.bench.multi_model [--models 10] [--busy 2] [--clients 8] \\
        [--duration 20] [--lone 200] [--threads 1] [--json]

It builds a repository of --models copies of the bundled demo export (m0, m1, ...), then
measures two setups with the same server flags (--threads, metrics and HTTP off):

- **repository**: one `serve --model-repository DIR` process, every model loaded (--load
  eager); with --repository-workers N, N worker processes, each with every model;
- **separate**: one `serve --model DIR` process per model.

In each setup: the resident memory once every model is loaded and idle; the lone latency (p50
/ p99 over --lone sequential one-text requests to the last model, nothing else running); then
the first --busy models saturated by the load generator (--clients closed-loop clients each,
tfserve.bench.closed_loop, for --duration seconds) while the same lone client measures the
last model again; and the resident memory (VmRSS) at the end of the load and its peak
(VmHWM), summed over the processes of the setup. The lone client starts once the load runs
and stops when it ends (the requests it completed under load are counted).

Everything runs on this machine: the load generator's processes share the cores with the
servers, as they would share them with any neighbour.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tfserve.bench.closed_loop import LevelResult, run_level
from tfserve.bench.common import percentile_ms, proc_status_kib, stop_process
from tfserve.bench.loadgen import number_phrases


@dataclass
class Setup:
    """One setup's figures (memory in MiB, latencies in ms)."""

    name: str
    processes: int
    idle_rss_mib: float = 0.0
    loaded_rss_mib: float = 0.0  # at the end of the load
    peak_rss_mib: float = 0.0  # VmHWM, summed over the processes
    quiet_p50_ms: float = 0.0
    quiet_p99_ms: float = 0.0
    busy_p50_ms: float = 0.0
    busy_p99_ms: float = 0.0
    busy_lone_requests: int = 0
    load_texts_per_s: list[float] = field(default_factory=list)
    load_errors: int = 0


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a server's --workers), from /proc (Linux)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            children = (task / "children").read_text().split()
            pending += [int(child) for child in children]
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """`python -m tfserve serve ...` on a port of its own, quiet (warnings only); with
    `http`, its HTTP front end on another (`http_port`), else none."""

    def __init__(self, flags: Sequence[str], threads: int, http: bool = False) -> None:
        self.port = _free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_port = _free_port() if http else 0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tfserve", "serve", *flags, "--host", "127.0.0.1",
             "--port", str(self.port), "--metrics-port", "0", "--http-port",
             str(self.http_port), "--threads", str(threads), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_serving(self, timeout: float = 300.0) -> None:
        """Until gRPC health says SERVING (asked every 0.1 s)."""
        from tfserve.client import Client

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read()[-2000:]}")
            try:
                with Client(self.target, timeout=2) as client:
                    if client.health() == "SERVING":
                        return
            except RuntimeError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server on {self.target} did not start in {timeout:.0f} s")

    def rss_kib(self) -> int:
        """The resident memory of the server's processes (its workers included)."""
        return sum(proc_status_kib(pid, "VmRSS") for pid in _process_tree(self.process.pid))

    def peak_kib(self) -> int:
        return sum(proc_status_kib(pid, "VmHWM") for pid in _process_tree(self.process.pid))

    def stop(self) -> None:
        stop_process(self.process)


def build_repository(directory: Path, count: int) -> list[str]:
    """`count` copies of the demo export, m0 ... m{count-1}; their names."""
    from tfserve.demo import default_artifacts

    demo = default_artifacts()
    names = [f"m{index}" for index in range(count)]
    for name in names:
        shutil.copytree(demo, directory / name)
    return names


def lone_latencies(target: str, model: str, texts: list[str], count: int,
                   stop: threading.Event | None = None) -> list[float]:
    """Sequential one-text requests to `model`: `count` of them, or until `stop` is set."""
    from tfserve.client import Client

    latencies = []
    with Client(target, timeout=120) as client:
        client.translate([texts[0]], model=model)  # connect and warm up
        for index in range(count):
            if stop is not None and stop.is_set():
                break
            started = time.perf_counter()
            client.translate([texts[index % len(texts)]], model=model)
            latencies.append(time.perf_counter() - started)
    return latencies


def measure(setup: Setup, servers: list[Server], targets: list[tuple[str, str]],
            args: argparse.Namespace, texts: list[str]) -> None:
    """The figures of one setup: `targets` holds (server target, model) per model, the busy
    ones first, the lone one last."""
    for server in servers:
        server.wait_serving()
    lone_target, lone_model = targets[-1]
    for target, model in targets:  # every model answers once before the figures
        lone_latencies(target, model, texts, 1)
    setup.idle_rss_mib = round(sum(s.rss_kib() for s in servers) / 1024, 1)
    quiet = lone_latencies(lone_target, lone_model, texts, args.lone)
    setup.quiet_p50_ms, setup.quiet_p99_ms = percentile_ms(quiet, 50), percentile_ms(quiet, 99)
    results: list[LevelResult] = []
    done = threading.Event()

    def load(target: str, model: str) -> None:
        results.append(run_level(target, args.clients, 10**9, args.duration, texts, 1,
                                 {"model": model}, processes=args.processes))

    loaders = [threading.Thread(target=load, args=target) for target in targets[:args.busy]]
    for thread in loaders:
        thread.start()
    time.sleep(args.ramp)  # the load generator's processes start and warm up
    busy: list[float] = []
    lone = threading.Thread(target=lambda: busy.extend(
        lone_latencies(lone_target, lone_model, texts, args.lone * 100, done)))
    lone.start()
    for thread in loaders:
        thread.join()
    setup.loaded_rss_mib = round(sum(s.rss_kib() for s in servers) / 1024, 1)
    done.set()
    lone.join()
    setup.peak_rss_mib = round(sum(s.peak_kib() for s in servers) / 1024, 1)
    setup.busy_p50_ms, setup.busy_p99_ms = percentile_ms(busy, 50), percentile_ms(busy, 99)
    setup.busy_lone_requests = len(busy)
    setup.load_texts_per_s = [round(result.texts_per_s, 1) for result in results]
    setup.load_errors = sum(result.errors for result in results)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tfserve.bench.multi_model",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", type=int, default=10, help="models in the repository")
    parser.add_argument("--busy", type=int, default=2, help="models under load")
    parser.add_argument("--clients", type=int, default=8,
                        help="closed-loop clients per busy model")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--ramp", type=float, default=3.0,
                        help="seconds between starting the load and the lone client")
    parser.add_argument("--lone", type=int, default=200,
                        help="lone requests measured with nothing else running")
    parser.add_argument("--threads", type=int, default=1, help="--threads of every server")
    parser.add_argument("--repository-workers", type=int, default=1,
                        help="--workers of the repository server (each worker loads every "
                             "model)")
    parser.add_argument("--processes", type=int, default=0,
                        help="load generator processes per busy model (0: one per core)")
    parser.add_argument("--setups", default="repository,separate",
                        help="which setups to measure, in order")
    parser.add_argument("--json", action="store_true", help="one JSON object per setup")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.busy < args.models:
        print("repository: error: --busy must be at least 1 and leave a model idle",
              file=sys.stderr)
        return 2
    texts = number_phrases(1000)
    work = Path(tempfile.mkdtemp(prefix="tfserve-repository-bench-"))
    figures: list[Setup] = []
    try:
        names = build_repository(work / "repository", args.models)
        for kind in [kind.strip() for kind in args.setups.split(",") if kind.strip()]:
            if kind == "repository":
                servers = [Server(["--model-repository", str(work / "repository"),
                                   "--workers", str(args.repository_workers)], args.threads)]
                targets = [(servers[0].target, name) for name in names]
            elif kind == "separate":
                servers = [Server(["--model", str(work / "repository" / name)], args.threads)
                           for name in names]
                targets = [(server.target, name) for server, name in zip(servers, names)]
            else:
                print(f"repository: error: unknown setup {kind!r}", file=sys.stderr)
                return 2
            processes = len(servers) if kind == "separate" else args.repository_workers
            setup = Setup(kind, processes)
            try:
                measure(setup, servers, targets, args, texts)
            finally:
                for server in servers:
                    server.stop()
            figures.append(setup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures, args)
    return 0


def report(figures: list[Setup], args: argparse.Namespace) -> None:
    if args.json:
        for setup in figures:
            print(json.dumps(asdict(setup)))
        return
    print(f"{args.models} demo models, {args.busy} under load ({args.clients} clients each, "
          f"{args.duration:.0f} s), --threads {args.threads}, {os.cpu_count()} cores")
    header = ("setup", "procs", "idle MiB", "loaded MiB", "peak MiB", "quiet p50/p99 ms",
              "busy p50/p99 ms", "lone n", "load texts/s")
    print(" | ".join(header))
    for s in figures:
        print(" | ".join(str(value) for value in (
            s.name, s.processes, s.idle_rss_mib, s.loaded_rss_mib, s.peak_rss_mib,
            f"{s.quiet_p50_ms}/{s.quiet_p99_ms}", f"{s.busy_p50_ms}/{s.busy_p99_ms}",
            s.busy_lone_requests, "+".join(map(str, s.load_texts_per_s)))))


if __name__ == "__main__":
    sys.exit(main())
