"""The gRPC listener around the Translator service (tfserve.frontends.grpc_api): grpc.aio
server options, TLS, the bearer-token interceptor, health and reflection.

Health: `""` and `tfserve.v1.Translator` are the server's (SERVING from the start until the
drain), and `tfserve.v1.Translator/<model>` each model's (`MODEL_HEALTH_PREFIX`): SERVING
while the model is loaded or can be loaded, NOT_SERVING when its last load failed,
SERVICE_UNKNOWN once it is removed from the repository.

grpc.aio runs every RPC on one event loop (the HTTP front end shares it); the model only ever
runs on the scheduler's worker thread, and results come back through futures
(tfserve.serving.calls). tfserve.server.translator_server starts and drains it beside the HTTP
front end, around one ServingCore.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from tfserve.frontends.front_end import Shared
from tfserve.frontends.grpc_api import SERVICE_NAME, TranslatorService, add_translator_service
from tfserve.frontends.messages import pb2 as translator_pb2
from tfserve.frontends.oip_grpc import SERVICE as INFERENCE
from tfserve.frontends.oip_grpc import add_inference_service
from tfserve.serving import REQUEST_ID_KEY, ServingCore
from tfserve.serving.auth import REPEATED, BearerAuth
from tfserve.serving.settings import ServerConfig

log = logging.getLogger("tfserve.server")

MODEL_HEALTH_PREFIX = f"{SERVICE_NAME}/"  # + a model's name: that model's health service


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <token>` matches; health is exempt. A
    refused call is counted, logged and warned about by `auth` (tfserve.serving.auth)."""

    EXEMPT_PREFIX = "/grpc.health.v1.Health/"

    def __init__(self, auth: BearerAuth) -> None:
        self.auth = auth

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self.EXEMPT_PREFIX):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        refusal = self.auth.check([value for key, value in metadata if key == "authorization"])
        if not refusal:
            return handler
        reason = ("more than one `authorization` metadata entry" if refusal == REPEATED
                  else "missing or wrong bearer token in `authorization` metadata")
        given_id = next((value for key, value in metadata
                         if key == REQUEST_ID_KEY and isinstance(value, str)), "")

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            # here, not in the interceptor: only the call's context knows its peer
            self.auth.refused("grpc", refusal, method.rsplit("/", 1)[-1], context.peer(),
                              given_id)
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


INFERENCE_SERVICE = INFERENCE.full_name


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """The files of every service this server offers, in one pool for the reflection service:
    the Open Inference Protocol's messages live in a pool of their own
    (tfserve.proto.private_pool), the others in protobuf's default pool."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:  # a file's imports go in first
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for file in (translator_pb2.DESCRIPTOR, INFERENCE.file, health_pb2.DESCRIPTOR,
                 reflection_pb2.DESCRIPTOR):
        add(file)
    return pool


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


class GrpcServer:
    """The gRPC front end of one ServingCore (a tfserve.frontends.FrontEnd): the grpc.aio
    server with the Translator service, health and reflection, on --host:--port.

    `await bind()` listens (RuntimeError naming --port when it cannot), `await serve()`
    serves and sets health SERVING; on a drain, `await not_serving()` then
    `await stop(grace)`. `shared_port`: one of --workers processes, which share the port
    (tfserve.server.worker_processes).
    """

    port_field = "port"

    def __init__(self, core: ServingCore, shared_port: bool = False,
                 auth: BearerAuth | None = None) -> None:
        self.core = core
        self.config = core.config
        self.shared_port = shared_port
        self.auth = auth  # the token's check, shared with HTTP (None: built from the config)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None

    async def bind(self) -> None:
        """Build the server and listen; RuntimeError naming --port when the port is busy."""
        config = self.config
        auth = self.auth or (BearerAuth(config.auth_token, self.core.metrics)
                             if config.auth_token else None)
        interceptors = [BearerTokenInterceptor(auth)] if auth is not None else []
        server = grpc.aio.server(options=server_options(config, self.shared_port),
                                 interceptors=interceptors)
        add_translator_service(TranslatorService(self.core), server)
        add_inference_service(self.core, server)  # the Open Inference Protocol, on this port
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
            server, pool=reflection_pool())
        address = listen_address(config)
        self.port = bind(server, config, address)
        if self.port == 0:
            raise RuntimeError(f"--port {config.port}: cannot listen on {address}")
        self._server = server

    async def serve(self) -> None:
        """Serve (after bind()), health SERVING."""
        assert self._server is not None, "bind() first"
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        repository = self.core.repository
        for model, status in repository.healths():
            await self.health.set(MODEL_HEALTH_PREFIX + model,
                                  health_pb2.HealthCheckResponse.ServingStatus.Value(status))
        repository.add_listener(self._model_health)

    def _model_health(self, model: str, status: str) -> None:
        """A model's health changed (ModelRepository listener, on the event loop)."""
        value = health_pb2.HealthCheckResponse.ServingStatus.Value(status)
        asyncio.get_running_loop().create_task(
            self.health.set(MODEL_HEALTH_PREFIX + model, value))

    async def not_serving(self) -> None:
        """Health NOT_SERVING (the drain's first step; new RPCs are refused by the core)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None) -> None:
        """Stop; RPCs still running get `grace` seconds (None: until they end)."""
        if self._server is not None:
            await self._server.stop(grace)


def grpc_front_end(shared: Shared) -> GrpcServer:
    """The gRPC front end (always on: --port)."""
    return GrpcServer(shared.core, shared.shared_port, shared.auth)
