"""One server process: a ServingCore and its front ends (FRONT_ENDS: HTTP unless --http-port
is 0, then gRPC; tfserve.frontends), on one event loop. `run_server` builds it (tracing set up
first, then the models loaded) and serves until SIGTERM / SIGINT; `serve` is the same on a
running event loop.

Start: the metrics port, then each front end binds (a busy port fails here, naming its flag,
before anything runs that would need stopping), then the models' workers, then the front ends
serve.

Drain (SIGTERM / SIGINT, `serve`): new calls of every front end
UNAVAILABLE (503 over HTTP), gRPC health NOT_SERVING and HTTP /readyz 503, calls in flight
finish within --grace-seconds, then the front ends (in the reverse order) and the models'
workers stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from tfserve.argparsing import EXIT_USAGE
from tfserve.frontends import FrontEnd, FrontEndFactory, Shared
from tfserve.frontends.grpc_server import grpc_front_end
from tfserve.frontends.http_server import http_front_end
from tfserve.serving import ServedModel, ServingCore
from tfserve.serving.auth import BearerAuth
from tfserve.serving.process_tuning import event_loop_runner, keep_freed_memory
from tfserve.serving.settings import ServerConfig
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.server")
# the front ends of a server process, in the order they bind (and the reverse of the order
# they stop in); each factory gives None when the settings turn its front end off
FRONT_ENDS: tuple[FrontEndFactory, ...] = (http_front_end, grpc_front_end)
# file descriptors a server needs besides its clients' connections: listening sockets, the
# event loop's and gRPC's own, model files, the metrics port's connections, logs
RESERVED_FILES = 256


def open_files_for(config: ServerConfig) -> None:
    """Raise this process's soft limit on open files (`ulimit -n`) to what the connection
    limits need, as far as the hard limit allows; warn when it cannot.

    Every connection a client holds is a file descriptor. At the common soft limit of 1024,
    --max-connections and --http-max-connections (1000 each by default) are out of reach: the
    process runs out of descriptors first, and then every port fails at once (accept errors,
    gRPC calls stalling, the metrics port silent) instead of the limit refusing the
    connections over it.
    """
    try:
        import resource
    except ImportError:  # not POSIX: the platform's own limits apply
        return
    needed = (config.max_connections + (config.http_max_connections if config.http_port else 0)
              + RESERVED_FILES)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft < needed:
        log.warning("the open-file limit is under what the connection limits need: connections "
                    "past it fail on every port; raise `ulimit -n` or lower the limits",
                    extra={"fields": {"event": "open_files", "limit": soft, "needed": needed,
                                      "max_connections": config.max_connections,
                                      "http_max_connections": config.http_max_connections}})


class TranslatorServer:
    """ServingCore + its front ends + metrics endpoint.

    `await start()` binds and serves; `await drain()` is the SIGTERM path. `runtime` is a
    model built by the caller (a tfserve.serving.ServedModel), served as the one model (None:
    what the config names); `worker` is the index of one of --workers processes
    (tfserve.server.worker_processes), which share their ports. Building it loads the models
    (--load eager) before any event loop runs.
    """

    def __init__(self, config: ServerConfig, runtime: ServedModel | None = None,
                 metrics: Metrics | None = None, worker: int | None = None,
                 front_ends: tuple[FrontEndFactory, ...] = FRONT_ENDS) -> None:
        self.core = ServingCore(config, runtime, metrics)
        self.config = self.core.config
        self.worker = worker
        # one check of the bearer token for every transport: one count of the calls it
        # refuses, one rate of warnings about them
        auth = (BearerAuth(self.config.auth_token, self.core.metrics)
                if self.config.auth_token else None)
        shared = Shared(self.core, self.not_ready, auth, shared_port=worker is not None)
        self.front_ends: list[FrontEnd] = [
            front_end for make in front_ends if (front_end := make(shared)) is not None]
        self.serving = False  # set once every front end serves; /readyz is 200 from then on

    def ports(self) -> dict[str, int]:
        """Each front end's bound port, by its field in the `serving` log record (`port`:
        gRPC's, the one picked for --port 0; `http_port`)."""
        return {front_end.port_field: front_end.port for front_end in self.front_ends}

    def not_ready(self) -> str:
        """Why the server takes no calls now ("" when it does): /readyz reads it."""
        if self.core.calls.draining:
            return "the server is shutting down"
        if not self.serving:
            return "the server is starting"
        return ""

    async def start(self) -> None:
        config = self.config
        open_files_for(config)
        self.core.serve_metrics()
        bound: list[FrontEnd] = []
        try:
            for front_end in self.front_ends:
                await front_end.bind()
                bound.append(front_end)
        except BaseException:
            for front_end in reversed(bound):
                await front_end.stop(0)
            self.core.metrics.close()
            raise
        self.core.start()
        for front_end in self.front_ends:
            await front_end.serve()
        self.serving = True
        repository = self.core.repository
        default = repository.loaded()
        log.info("serving", extra={"fields": {
            "event": "serving", "host": config.host, **self.ports(),
            **({} if self.worker is None else {"worker": self.worker, "pid": os.getpid()}),
            "metrics_port": self.core.metrics_port,
            "model": default.runtime.config.name if default is not None else "",
            "models": list(repository.slots),
            "loaded": sorted(model.name for model in repository.resident),
            "tls": config.tls_cert is not None, "mutual_tls": config.tls_client_ca is not None,
            "auth": bool(config.auth_token),
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
            **({"device": config.device} if default is None else default.runtime.describe())}})

    async def drain(self, grace: float | None = None) -> None:
        """Not ready, reject new calls, let those in flight finish within grace, stop."""
        grace = self.config.grace_seconds if grace is None else grace
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        self.core.begin_drain()
        for front_end in self.front_ends:
            await front_end.not_serving()
        log.info("draining", extra={"fields": {
            "event": "draining", "in_flight": self.core.calls.in_flight,
            "grace_seconds": grace}})
        await self.core.wait_idle(grace)
        # what is left are health watches and reflection streams, or calls past the grace
        rest = min(max(deadline - loop.time(), 0.0), 1.0)
        for front_end in reversed(self.front_ends):
            await front_end.stop(rest)
        await self.core.stop()

    async def stop_now(self) -> None:
        """Stop without waiting for the calls in flight (a second signal during the drain)."""
        for front_end in reversed(self.front_ends):
            await front_end.stop(0)
        self.core.stop_now()


async def serve(config: ServerConfig, runtime: ServedModel | None = None,
                worker: int | None = None, on_serving: Callable[[], None] | None = None,
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
