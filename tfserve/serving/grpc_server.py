"""The gRPC server around a ServingCore: grpc.aio server options, TLS, the bearer-token
interceptor, the Translator service, health and reflection, and the start / drain steps.

grpc.aio runs every RPC on one event loop; the model only ever runs on the scheduler's worker
thread, and results come back through futures (tfserve.serving.calls).

Shutdown (SIGTERM / SIGINT, tfserve.server.serve): health goes NOT_SERVING, new RPCs get
UNAVAILABLE, RPCs in flight finish within --grace-seconds, then the server stops.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tfserve.metrics import Metrics
from tfserve.serving.core import ServingCore
from tfserve.serving.grpc_api import SERVICE_NAME, TranslatorService, add_translator_service
from tfserve.settings import ServerConfig

log = logging.getLogger("tfserve.server")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <token>` matches; health is exempt."""

    EXEMPT_PREFIX = "/grpc.health.v1.Health/"

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.EXEMPT_PREFIX):
            return handler
        given = [value for key, value in handler_call_details.invocation_metadata or ()
                 if key == "authorization"]
        if len(given) == 1:
            value = given[0]
            given_bytes = value.encode() if isinstance(value, str) else bytes(value)
            if hmac.compare_digest(given_bytes, self.expected):
                return handler
        # more than one header is refused whatever they hold: which one a proxy or a
        # framework reads is not ours to guess
        reason = ("more than one `authorization` metadata entry" if len(given) > 1
                  else "missing or wrong bearer token in `authorization` metadata")

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await deny(request, context)
            yield  # an async generator, as the stream handler it replaces

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                deny, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                deny, handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer)


def server_options(config: ServerConfig, shared_port: bool) -> list[tuple[str, int]]:
    """grpc.aio server options from the settings; shared_port: one of --workers processes."""
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # a second server on a busy port must fail, not silently share it; the workers of
        # one `--workers N` server share theirs (the parent checked that it was free)
        ("grpc.so_reuseport", 1 if shared_port else 0),
        # bounds on what clients may hold open: calls per connection, connections
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
    ]
    if config.max_connection_age_seconds > 0:
        # clients reconnect, and the kernel spreads them again over --workers
        options += [
            ("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
            ("grpc.max_connection_age_grace_ms", int(config.grace_seconds * 1000)),
        ]
    return options


def listen_address(config: ServerConfig) -> str:
    """--host:--port as grpc takes it (an IPv6 host in brackets)."""
    return f"[{config.host}]:{config.port}" if ":" in config.host else (
        f"{config.host}:{config.port}")


def bind(server: grpc.aio.Server, config: ServerConfig, address: str) -> int:
    """Listen on address, with TLS when configured; the bound port (0: it failed)."""
    try:
        if config.tls_cert is not None and config.tls_key is not None:
            client_ca = config.tls_client_ca
            credentials = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                root_certificates=client_ca.read_bytes() if client_ca else None,
                require_client_auth=client_ca is not None)
            return int(server.add_secure_port(address, credentials))
        return int(server.add_insecure_port(address))
    except RuntimeError:  # grpc's "failed to bind" in newer versions
        return 0


class TranslatorServer:
    """ServingCore + grpc.aio server + health + reflection + metrics endpoint.

    `await start()` binds and serves; `await drain()` is the SIGTERM path. `runtime` is any
    object with Runtime's interface (Backend + .tokenizer, .config, .manifest).
    """

    def __init__(self, config: ServerConfig, runtime: Any | None = None,
                 metrics: Metrics | None = None, worker: int | None = None) -> None:
        self.core = ServingCore(config, runtime, metrics)
        self.config = self.core.config
        # one of --workers processes (tfserve.workers): it shares the port with the others
        self.worker = worker
        self.runtime = self.core.runtime
        self.metrics = self.core.metrics
        self.scheduler = self.core.scheduler
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None

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

    async def start(self) -> None:
        config = self.config
        self.core.serve_metrics()
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        server = grpc.aio.server(options=server_options(config, self.worker is not None),
                                 interceptors=interceptors)
        add_translator_service(TranslatorService(self.core), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = listen_address(config)
        self.port = bind(server, config, address)
        if self.port == 0:
            self.metrics.close()
            raise RuntimeError(f"--port {config.port}: cannot listen on {address}")
        self.core.start()
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"fields": {
            "event": "serving", "host": config.host, "port": self.port,
            **({} if self.worker is None else {"worker": self.worker, "pid": os.getpid()}),
            "metrics_port": self.metrics_port, "model": self.runtime.config.name,
            "tls": config.tls_cert is not None, "mutual_tls": config.tls_client_ca is not None,
            "auth": bool(config.auth_token),
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
            **self.runtime.describe()}})

    async def drain(self, grace: float | None = None) -> None:
        """NOT_SERVING, reject new RPCs, let those in flight finish within grace, stop."""
        grace = self.config.grace_seconds if grace is None else grace
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        self.core.begin_drain()
        await self.health.enter_graceful_shutdown()
        log.info("draining", extra={"fields": {"event": "draining", "in_flight": self.in_flight,
                                               "grace_seconds": grace}})
        await self.core.wait_idle(grace)
        if self._server is not None:
            # what is left are health watches and reflection streams, or RPCs past the grace
            await self._server.stop(min(max(deadline - loop.time(), 0.0), 1.0))
        await self.core.stop()

    async def stop_now(self) -> None:
        """Stop without waiting for the RPCs in flight (a second signal during the drain)."""
        if self._server is not None:
            await self._server.stop(0)
        self.scheduler.stop()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
