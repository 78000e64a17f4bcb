"""One server process: a ServingCore and its front ends, gRPC (tfserve.serving.grpc_server)
and, unless --http-port is 0, HTTP (tfserve.serving.http_server), on one event loop.

Start: the metrics port, then HTTP and gRPC bind (a busy port fails here, naming its flag,
before anything runs that would need stopping), then the scheduler, then gRPC serves.

Drain (SIGTERM / SIGINT, tfserve.server.main.serve): gRPC health NOT_SERVING and HTTP /readyz 503,
new calls of either transport UNAVAILABLE (503 over HTTP), calls in flight finish within
--grace-seconds, then both listeners and the scheduler stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from tfserve.serving.auth import BearerAuth
from tfserve.serving.core import ServingCore
from tfserve.serving.grpc_server import GrpcServer
from tfserve.serving.http_server import HttpServer
from tfserve.serving.settings import ServerConfig
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.server")
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
    """ServingCore + gRPC + HTTP + metrics endpoint.

    `await start()` binds and serves; `await drain()` is the SIGTERM path. `runtime` is any
    object with Runtime's interface (Backend + .tokenizer, .config, .manifest), served as the
    one model (None: what the config names); `worker` is the index of one of --workers
    processes (tfserve.server.worker_processes), which share their ports. Building it loads the
    models
    (--load eager) before any event loop runs.
    """

    def __init__(self, config: ServerConfig, runtime: Any | None = None,
                 metrics: Metrics | None = None, worker: int | None = None) -> None:
        self.core = ServingCore(config, runtime, metrics)
        self.config = self.core.config
        self.worker = worker
        self.metrics = self.core.metrics
        self.repository = self.core.repository
        # one check of the bearer token for both transports: one count of the calls it
        # refuses, one rate of warnings about them
        self.auth = (BearerAuth(self.config.auth_token, self.metrics)
                     if self.config.auth_token else None)
        self.grpc = GrpcServer(self.core, shared_port=worker is not None, auth=self.auth)
        self.health = self.grpc.health
        self.http = (HttpServer(self.core, self.not_ready, shared_port=worker is not None,
                                auth=self.auth)
                     if self.config.http_port else None)
        self.serving = False  # set once every listener serves; /readyz is 200 from then on

    # the default model's runtime and scheduler while it is loaded (None otherwise): a
    # one-model server's, for tests and tools
    @property
    def runtime(self) -> Any:
        return self.core.runtime

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    # the core's state, read by the drain's log line and by tests
    @property
    def draining(self) -> bool:
        return self.core.calls.draining

    @property
    def in_flight(self) -> int:
        return self.core.calls.in_flight

    @property
    def metrics_port(self) -> int:
        return self.core.metrics_port

    @property
    def port(self) -> int:
        """The gRPC port (the one picked, for --port 0)."""
        return self.grpc.port

    @property
    def http_port(self) -> int:
        """The HTTP port (0: HTTP is off)."""
        return self.http.port if self.http is not None else 0

    def not_ready(self) -> str:
        """Why the server takes no calls now ("" when it does): /readyz reads it."""
        if self.draining:
            return "the server is shutting down"
        if not self.serving:
            return "the server is starting"
        return ""

    async def start(self) -> None:
        config = self.config
        open_files_for(config)
        self.core.serve_metrics()
        try:
            if self.http is not None:
                await self.http.start()
            self.grpc.bind()
        except BaseException:
            if self.http is not None:
                await self.http.stop()
            self.metrics.close()
            raise
        self.core.start()
        await self.grpc.start()
        self.serving = True
        default = self.core.default_model
        log.info("serving", extra={"fields": {
            "event": "serving", "host": config.host, "port": self.port,
            "http_port": self.http_port,
            **({} if self.worker is None else {"worker": self.worker, "pid": os.getpid()}),
            "metrics_port": self.metrics_port,
            "model": default.runtime.config.name if default is not None else "",
            "models": list(self.repository.slots),
            "loaded": sorted(model.name for model in self.repository.resident),
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
        await self.grpc.not_serving()
        log.info("draining", extra={"fields": {"event": "draining", "in_flight": self.in_flight,
                                               "grace_seconds": grace}})
        await self.core.wait_idle(grace)
        # what is left are health watches and reflection streams, or calls past the grace
        await self.grpc.stop(min(max(deadline - loop.time(), 0.0), 1.0))
        if self.http is not None:
            await self.http.stop()
        await self.core.stop()

    async def stop_now(self) -> None:
        """Stop without waiting for the calls in flight (a second signal during the drain)."""
        await self.grpc.stop(0)
        if self.http is not None:
            await self.http.stop()
        self.core.stop_now()

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()
