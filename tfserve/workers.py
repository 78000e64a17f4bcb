"""Several server processes on one port: `python -m tfserve serve --workers N`.

Why: one server process runs its event loop (gRPC in Python) and its decoding loop under one
interpreter lock, so on a small model it stops scaling long before the cores are busy
(docs/benchmarks.md: the demo at 32 clients used 1.3 of 2 cores). N workers are N complete
servers (model copy, scheduler, batch, gRPC, health, metrics), so N locks.

How:
- The parent checks that the port is free (or picks one for `--port 0`) and keeps it reserved
  for as long as it runs: a socket bound with SO_REUSEPORT that never listens, so no other
  program can take the port, and the kernel hands connections only to listening sockets.
- It starts the workers (spawned processes, each in a session of its own), which bind the
  same port with SO_REUSEPORT; the kernel spreads incoming *connections* over them. A client
  that sends everything over one channel is served by one worker: spread load over several
  channels, or put a connection-balancing proxy in front (docs/server.md).
- Worker i serves Prometheus metrics on `--metrics-port + i`.
- With `--threads 0`, each worker takes cores // N intra-op threads (at least 1), not one per
  core each.
- SIGTERM or SIGINT to the parent is passed on once to every worker, which drains as a single
  server does (NOT_SERVING, UNAVAILABLE for new calls, in-flight calls finish within
  `--grace-seconds`); a second signal is passed on too and stops them at once. The parent exits
  0 when every worker did.
- A worker that exits on its own (a failed start, a crash) stops the others: the parent exits
  with that worker's code, for the supervisor (Docker, Kubernetes) to restart the whole set.
  Workers also get SIGTERM if the parent dies (Linux parent-death signal).
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
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tfserve.settings import ServerConfig

log = logging.getLogger("tfserve.server")

EXIT_USAGE = 2
_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, not listening: the workers' port.

    Raises OSError naming --port when anything holds the port (including another tfserve's
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
        raise OSError(f"--port {port}: cannot bind {host}:{port}: {exc.strerror}") from None
    finally:
        probe.close()
    reservation = socket.socket(family, kind, proto)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        reservation.bind(address)
    except OSError as exc:
        reservation.close()
        raise OSError(f"--port {address[1]}: taken while starting: {exc.strerror}") from None
    return reservation


def worker_configs(config: ServerConfig, port: int) -> list[ServerConfig]:
    """Each worker's settings: the reserved port, metrics_port + i, its share of the cores."""
    threads = config.threads or max(1, (os.cpu_count() or 1) // config.workers)
    return [replace(config, port=port, threads=threads, workers=1,
                    metrics_port=config.metrics_port + index if config.metrics_port else 0)
            for index in range(config.workers)]


def _worker(config: ServerConfig, index: int) -> None:
    """A worker process: its own session (a terminal's Ctrl-C reaches the parent only, which
    passes it on once), SIGTERM if the parent dies, then a whole server."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not glibc: an orphaned worker is stopped by hand
        pass
    from tfserve.server import run_server, setup_logging

    setup_logging(config.log_format, config.log_level)
    sys.exit(run_server(config, worker=index))


def run_workers(config: ServerConfig) -> int:
    """Start config.workers server processes on one port and supervise them; the exit code."""
    if config.model is None:  # export the bundled demo once here, not once per worker
        from tfserve.demo import default_artifacts

        config = replace(config, model=default_artifacts())
    try:
        reservation = reserve_port(config.host, config.port)
    except OSError as exc:
        log.error("cannot serve: %s", exc)
        return EXIT_USAGE
    port = reservation.getsockname()[1]
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads
    workers: list[Any] = []
    signals = 0

    def pass_on(signum: int, frame: Any) -> None:
        nonlocal signals
        signals += 1
        for worker in workers:
            if worker.exitcode is None:
                os.kill(worker.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        configs = worker_configs(config, port)
        for index, worker_config in enumerate(configs):
            worker = context.Process(target=_worker, args=(worker_config, index),
                                     name=f"tfserve-worker-{index}")
            worker.start()
            workers.append(worker)
            if signals:  # stopped while starting: this one missed the signal
                os.kill(worker.pid, signal.SIGTERM)
        log.info("workers", extra={"fields": {
            "event": "workers", "workers": len(workers), "port": port,
            "pids": [w.pid for w in workers], "threads": configs[0].threads,
            "metrics_ports": [c.metrics_port for c in configs if c.metrics_port]}})
        return _supervise(workers, lambda: signals, pass_on)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reservation.close()


def _supervise(workers: list[Any], signals: Callable[[], int],
               stop: Callable[[int, Any], None]) -> int:
    """Wait for every worker. One that exits before any signal stops the others; the exit
    code is the first non-zero worker code (0 when all drained cleanly)."""
    first_failure = 0
    running = {worker.sentinel: worker for worker in workers}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            worker = running.pop(sentinel)
            worker.join()
            code = worker.exitcode  # negative: killed by that signal
            unexpected = not signals()
            if (code != 0 or unexpected) and not first_failure:
                first_failure = code if code and code > 0 else 1
            if unexpected:
                log.error("worker %s (pid %d) exited with code %s; stopping the others",
                          worker.name, worker.pid, code)
                stop(signal.SIGTERM, None)
    log.info("workers stopped", extra={"fields": {
        "event": "workers_stopped", "exit_codes": [w.exitcode for w in workers],
        "exit_code": first_failure}})
    return first_failure
