"""Several server processes on one port: `python -m tfserve serve --workers N`.

Why: one server process runs its event loop (gRPC in Python) and its decoding loop under one
interpreter lock, so on a small model it stops scaling long before the cores are busy
(docs/benchmarks.md: the demo at 32 clients used 1.3 of 2 cores). N workers are N complete
servers (model copy, scheduler, batch, gRPC, HTTP, health, metrics), so N locks. With
`--model-repository`, each worker serves the whole repository: its own copy of every loaded
model, and its own loads, unloads and rescans.

How:
- The parent checks that the port is free (or picks one for `--port 0`) and keeps it reserved
  for as long as it runs: a socket bound with SO_REUSEPORT that never listens, so no other
  program can take the port, and the kernel hands connections only to listening sockets. The
  same for `--http-port` (unless it is 0: HTTP off).
- It starts the workers (spawned processes, each in a session of its own), which bind the
  same ports with SO_REUSEPORT; the kernel spreads incoming *connections* over them. A client
  that sends everything over one channel is served by one worker: spread load over several
  channels, or put a connection-balancing proxy in front (docs/server.md).
- The parent serves every worker's Prometheus metrics on `--metrics-port`, each sample
  labelled `worker`, plus `tfserve_worker_up`; worker i also serves its own on
  `--metrics-port + 1 + i`.
- With `--threads 0`, each worker takes cores // N intra-op threads (at least 1), not one per
  core each.
- SIGTERM or SIGINT to the parent is passed on once to every worker, which drains as a single
  server does (NOT_SERVING, UNAVAILABLE for new calls, in-flight calls finish within
  `--grace-seconds`); a second signal is passed on too and stops them at once. The parent exits
  0 when every worker did.
- A worker that served and then died (a crash, a kill) is restarted in its place; the others
  serve on, their requests untouched. More than RESTARTS restarts within RESTART_WINDOW_S, or
  a worker that exits before it served (a bad model, a bad flag), stops the set: the parent
  exits with that worker's code (1 for a signal), for Docker or Kubernetes to act on.
  Workers get SIGTERM if the parent dies (Linux parent-death signal).
- Linux only: elsewhere SO_REUSEPORT lets processes share a port without spreading the
  connections over them.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from typing import Any

from tfserve.argparsing import EXIT_USAGE
from tfserve.serving.settings import ServerConfig
from tfserve.telemetry.metrics import serve_workers_metrics

log = logging.getLogger("tfserve.server")

RESTARTS = 5  # a worker that served and died is restarted, up to this many times ...
RESTART_WINDOW_S = 60.0  # ... within this many seconds; then the set stops
_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def reserve_port(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, not listening: the workers' port.

    Raises OSError naming `flag` when anything holds the port (including another tfserve's
    workers, which would share it silently if we only bound with SO_REUSEPORT).
    """
    if not sys.platform.startswith("linux"):  # elsewhere SO_REUSEPORT does not balance
        raise OSError(f"--workers needs Linux, where SO_REUSEPORT spreads connections over the "
                      f"processes that share a port; this is {sys.platform}")
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    probe = socket.socket(family, kind, proto)  # without SO_REUSEPORT: fails if the port is held
    try:
        probe.bind(address)
        address = probe.getsockname()  # the port picked for --port 0
    except OSError as exc:
        raise OSError(f"{flag} {port}: cannot bind {host}:{port}: {exc.strerror}") from None
    finally:
        probe.close()
    reservation = socket.socket(family, kind, proto)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        reservation.bind(address)
    except OSError as exc:
        reservation.close()
        raise OSError(f"{flag} {address[1]}: taken while starting: {exc.strerror}") from None
    return reservation


def worker_configs(config: ServerConfig, port: int) -> list[ServerConfig]:
    """Each worker's settings: the reserved port, metrics on metrics_port + 1 + i (the parent
    serves them all on metrics_port), its share of the cores."""
    threads = config.threads or max(1, (os.cpu_count() or 1) // config.workers)
    return [replace(config, port=port, threads=threads, workers=1,
                    metrics_port=config.metrics_port + 1 + index if config.metrics_port else 0)
            for index in range(config.workers)]


def metrics_url(host: str, port: int) -> str:
    """Where the parent reads a worker's /metrics (a wildcard host is reached on loopback)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


def _worker(config: ServerConfig, index: int, serving: Any) -> None:
    """A worker process: its own session (a terminal's Ctrl-C reaches the parent only, which
    passes it on once), SIGTERM if the parent dies, then a whole server; `serving` (an
    Event) is set once it listens."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not glibc: an orphaned worker is stopped by hand
        pass
    from tfserve.server.translator_server import run_server
    from tfserve.telemetry.logs import setup_logging

    setup_logging(config.log_format, config.log_level)
    sys.exit(run_server(config, worker=index, on_serving=serving.set))


class _Workers:
    """The worker processes, what they were told, and when they were restarted."""

    def __init__(self, configs: list[ServerConfig]) -> None:
        self.configs = configs
        self.context = multiprocessing.get_context("spawn")  # fresh: no inherited threads
        self.processes: dict[int, Any] = {}
        self.serving: dict[int, Any] = {}  # index -> Event set once that worker listened
        self.signals = 0
        self.restarts: list[float] = []
        self.exit_codes: dict[int, int | None] = {}

    def start(self, index: int) -> None:
        self.serving[index] = self.context.Event()
        process = self.context.Process(
            target=_worker, args=(self.configs[index], index, self.serving[index]),
            name=f"tfserve-worker-{index}")
        process.start()
        self.processes[index] = process
        if self.signals:  # stopped while starting: this one missed the signal
            os.kill(process.pid, signal.SIGTERM)

    def stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        """The parent's SIGTERM / SIGINT handler: pass it on to every live worker."""
        self.signals += 1
        for process in self.processes.values():
            if process.exitcode is None:
                os.kill(process.pid, signal.SIGTERM)

    def may_restart(self, index: int) -> bool:
        """Restart a worker that served and then died, unless the set is stopping or workers
        died too often lately (a fault that a restart does not cure)."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if self.signals or not self.serving[index].is_set() or len(self.restarts) >= RESTARTS:
            return False
        self.restarts.append(now)
        return True

    def supervise(self) -> int:
        """Wait until every worker exited; the first failure's exit code, else 0."""
        first_failure = 0
        while True:
            running = {p.sentinel: i for i, p in self.processes.items() if i not in self.exit_codes}
            if not running:
                break
            for sentinel in multiprocessing.connection.wait(list(running)):
                index = running[sentinel]
                process = self.processes[index]
                process.join()
                code = process.exitcode  # negative: killed by that signal
                stopping = bool(self.signals)  # told to stop: this is the drain ending
                if self.may_restart(index):  # never once stopping
                    log.warning("worker %d (pid %d) exited with code %s; restarting it", index,
                                process.pid, code)
                    self.start(index)
                    continue
                self.exit_codes[index] = code
                if (code != 0 or not stopping) and not first_failure:
                    # a signal's death (negative) or an unasked clean exit count as 1
                    first_failure = code if code and code > 0 else 1
                if not stopping:
                    log.error("worker %d (pid %d) exited with code %s%s; stopping the others",
                              index, process.pid, code,
                              "" if self.serving[index].is_set() else " before serving")
                    self.stop()
        log.info("workers stopped", extra={"fields": {
            "event": "workers_stopped",
            "exit_codes": [self.exit_codes[i] for i in sorted(self.exit_codes)],
            "exit_code": first_failure}})
        return first_failure


def run_workers(config: ServerConfig) -> int:
    """Start config.workers server processes on one port and supervise them; the exit code."""
    if config.model is None and config.model_repository is None:
        # export the bundled demo once here, not once per worker
        from tfserve.demo import default_artifacts

        try:
            config = replace(config, model=default_artifacts())
        except (ValueError, RuntimeError, OSError) as exc:
            log.error("cannot serve: %s", exc)
            return EXIT_USAGE
    reservations: list[socket.socket] = []
    try:
        reservations.append(reserve_port(config.host, config.port))
        if config.http_port:
            reservations.append(reserve_port(config.host, config.http_port, "--http-port"))
    except OSError as exc:
        for reservation in reservations:
            reservation.close()
        log.error("cannot serve: %s", exc)
        return EXIT_USAGE
    port = reservations[0].getsockname()[1]
    workers = _Workers(worker_configs(config, port))
    metrics = None
    if config.metrics_port:
        try:
            metrics = serve_workers_metrics(
                [metrics_url(config.metrics_bind_host(), c.metrics_port)
                 for c in workers.configs],
                config.metrics_port, config.metrics_bind_host())
        except OSError as exc:
            for reservation in reservations:
                reservation.close()
            log.error("cannot serve: %s", exc)
            return EXIT_USAGE
    previous = {sig: signal.signal(sig, workers.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(config.workers):
            workers.start(index)
        log.info("workers", extra={"fields": {
            "event": "workers", "workers": config.workers, "port": port,
            "http_port": config.http_port,
            "pids": [p.pid for p in workers.processes.values()],
            "threads": workers.configs[0].threads,
            "metrics_port": config.metrics_port,
            "worker_metrics_ports": [c.metrics_port for c in workers.configs if c.metrics_port]}})
        return workers.supervise()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        for reservation in reservations:
            reservation.close()
