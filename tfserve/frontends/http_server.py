"""The HTTP listener around the HTTP API (tfserve.frontends.http_api): an aiohttp runner on the
server's own event loop (asyncio or uvloop, the one gRPC runs on), TLS from the same
certificate, key and client CA as gRPC, the connections' limit and timeouts, and its start /
stop steps.

The handlers are cancelled when their client disconnects (aiohttp's handler_cancellation),
which cancels the call's work as a cancelled gRPC call does: its rows leave the batch before
the next decoder step.

What a connection may hold (docs/server.md, HTTP API):

    --http-max-connections            open at once; one more is closed as soon as it is accepted
    --http-header-timeout-seconds     from a request's first byte to the end of its headers
                                      (and, with TLS, the handshake)
    --http-body-timeout-seconds       from a request's headers to the end of its body
    --http-keepalive-timeout-seconds  idle, before its first request or after an answer
                                      (aiohttp's keepalive_timeout)

The first three are `Connections`, an asyncio protocol wrapped around aiohttp's: aiohttp has
no limit on connections and no timeout on a request's headers or body, and asyncio's server
accepts every connection. The wrapper is the one place that sees each connection open and
close and each byte arrive, through asyncio's public protocol interface, without reaching into
aiohttp's request handler; a middleware (`request_phases`) tells it when a request's headers
are in (its handler starts) and when its handler is done. A connection closed for one of
them is counted in tfserve_http_connections_dropped_total{reason}.

Behind each Connection, aiohttp's request handler is this module's `RequestHandler`: bytes its
parser refuses are answered with the server's JSON error and none of those bytes (aiohttp
quotes them, a bearer token maybe), and a request body they break ends with the parser's
error (aiohttp's handler would wait for the rest of it), so that its call is a 400.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader

from tfserve.frontends.front_end import Readiness, Shared
from tfserve.frontends.http_api import BODY_DROPPED, make_app
from tfserve.frontends.http_errors import Handler, error_response, malformed_reason
from tfserve.frontends.oip_rest import add_routes as add_oip_routes
from tfserve.serving import ServingCore, Status
from tfserve.serving.auth import BearerAuth
from tfserve.serving.settings import ServerConfig
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.server")
http_log = logging.getLogger("tfserve.http")  # what aiohttp's request handlers log
BACKLOG = 128  # connections the kernel queues before they are accepted (aiohttp's default)


def ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context from --tls-cert / --tls-key (None without them); with
    --tls-client-ca, clients must present a certificate signed by it (mutual TLS)."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    # a bare server context: no system CAs, so that with --tls-client-ca only certificates
    # signed by that CA are accepted (as gRPC's require_client_auth does)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
        if config.tls_client_ca is not None:
            context.load_verify_locations(cafile=str(config.tls_client_ca))
            context.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert {config.tls_cert} / --tls-key {config.tls_key}: "
                         f"cannot use them for HTTPS ({exc})") from None
    context.set_alpn_protocols(["http/1.1"])
    return context


class ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The logger of aiohttp's request handlers (RequestHandler's `logger`), on tfserve.http.

    A malformed request (aiohttp's parser refused it, answering 400) is one line without its
    bytes, not aiohttp's error record whose traceback quotes the offending line, header value
    included; a client that left is not an error (debug, without a traceback). Anything else
    passes on as aiohttp wrote it (a JSON log folds a traceback into the record's line).
    """

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc_info = kwargs.get("exc_info")
        if exc_info is True:
            exc_info = sys.exc_info()
        exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
        if isinstance(exc, HttpProcessingError):
            # aiohttp logs one kind (an unknown method on a new connection: a port scan, TLS
            # sent to a plain port) at debug level to keep it out of the logs: kept there
            remote = args[0] if args and isinstance(args[0], str) else ""
            self.logger.log(min(level, logging.INFO), "malformed HTTP request", extra={
                "fields": {"event": "bad_http_request", "remote": remote,
                           "http_status": exc.code or 400, "error": type(exc).__name__,
                           "reason": malformed_reason(exc)}})
        elif isinstance(exc, ConnectionError):
            self.logger.debug("HTTP client left: %s", type(exc).__name__)
        else:
            self.logger.log(level, msg, *args, **kwargs)


class RequestHandler(web_protocol.RequestHandler):
    """aiohttp's request handler (its protocol for one connection), with what it does with
    bytes its parser refuses changed in two places:

    - `handle_error`: its 400 to a malformed request quotes the offending line, a header's
      value (a bearer token) included; this one is the server's JSON error, INVALID_ARGUMENT,
      with a fixed message naming the problem and none of the request's bytes.
    - `data_received`: when the refused bytes are a request's body (a chunk size that is not
      hexadecimal, chunk data without its CRLF), aiohttp's C parser raises to the protocol
      only, and the body's reader waits for bytes that never come: the request's handler
      hangs until --http-body-timeout-seconds closes the connection. Here the body ends with
      the parser's error, so that its handler answers the call with it (a 400,
      tfserve.frontends.http_api), and the connection closes after that answer (its bytes no
      longer frame requests).
    """

    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._body: StreamReader | None = None  # the body of the last request parsed

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._messages:  # aiohttp's queue of parsed requests, not yet handled
            return
        message, body = self._messages[-1]
        # a request the parser refused is queued as aiohttp's error info (its `exc`), to be
        # answered by handle_error once the requests before it are
        error = getattr(message, "exc", None)
        if not isinstance(error, HttpProcessingError):
            self._body = body  # the parser feeds the last request's body only
            return
        unfinished, self._body = self._body, None
        if unfinished is None or unfinished.is_eof():
            return
        if unfinished.exception() is None:  # aiohttp's Python parser sets its own
            unfinished.set_exception(error)
        # at its end: aiohttp does not then wait for the rest of it (or fail reading it)
        # after the handler's answer
        unfinished.feed_eof()
        self.close()  # after the answer now being made; the refused request is not answered

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        # aiohttp's own steps without its text: the record (through ServerLog), and
        # ConnectionError where an answer was begun already
        super().handle_error(request, status, exc, "")
        response = error_response(Status.INVALID_ARGUMENT.name,
                                  f"malformed HTTP request: {malformed_reason(exc)}", status)
        response.force_close()
        return response


class Connections:
    """asyncio's protocol factory for the HTTP port: each connection a `Connection` around one
    of aiohttp's request handlers (`handlers` makes them: this module's RequestHandler), at
    most `limit` open at once, with the header and body timeouts of the module's
    docstring."""

    def __init__(self, handlers: Callable[[], asyncio.Protocol], limit: int,
                 header_timeout: float, body_timeout: float, metrics: Metrics) -> None:
        self.handlers = handlers
        self.limit = limit
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.open = 0  # connections served now: counted once made (with TLS, after handshake)

    def __call__(self) -> Connection:
        return Connection(self)

    def dropped(self, reason: str) -> None:
        self.metrics.http_dropped.labels(reason).inc()


class Connection(asyncio.Protocol):
    """One accepted connection: closed at once over the limit, else served by aiohttp's request
    handler behind it (every protocol call passed on), with its requests' deadlines."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections
        self.handler: asyncio.Protocol | None = None  # None: refused, or closed
        self.transport: asyncio.BaseTransport | None = None
        self.busy = False  # a request's handler runs: its headers are in
        self._deadline: asyncio.TimerHandle | None = None  # the header's or the body's
        # the body of the last request, while its handler left some of it to come: the bytes
        # that follow are that body (aiohttp reads and drops it), not a new request
        self._unread: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        connections = self.connections
        if connections.open >= connections.limit:
            connections.dropped("limit")
            transport.abort()  # no TLS close handshake: the socket is released at once
            return
        connections.open += 1
        connections.metrics.http_connections.inc()
        self.transport = transport
        self.handler = connections.handlers()
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.handler is None:
            return
        # the first byte of a request: its headers must be in by the deadline (bytes that come
        # later do not move it: a client trickling its headers is closed all the same)
        if self._unread is not None and self._unread.is_eof():
            self._unread = None
        if data and not self.busy and self._deadline is None and self._unread is None:
            self._deadline = self.connections.loop.call_later(
                self.connections.header_timeout, self._expired, "header_timeout", None)
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self.handler is not None:
            handler, self.handler, self.transport = self.handler, None, None
            self.connections.open -= 1
            self.connections.metrics.http_connections.dec()
            handler.connection_lost(exc)

    def request_started(self, request: web.BaseRequest) -> None:
        """A request's headers are in and its handler starts: its body, if it has one not
        received yet, must be in by the body deadline."""
        self.busy = True
        self._cancel_deadline()
        if request.body_exists and not request.content.is_eof():
            self._deadline = self.connections.loop.call_later(
                self.connections.body_timeout, self._expired, "body_timeout", request)

    def request_ended(self, request: web.BaseRequest) -> None:
        """The request's handler is done; the next byte after its body starts the next
        request."""
        self.busy = False
        self._cancel_deadline()
        if request.body_exists and not request.content.is_eof():
            self._unread = request.content

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, reason: str, request: web.BaseRequest | None) -> None:
        """A deadline passed: close the connection, unless the body it waited for (the
        request's) is in (the handler may stream its answer for longer)."""
        self._deadline = None
        if self.transport is None or (request is not None and request.content.is_eof()):
            return
        if request is not None:
            request[BODY_DROPPED] = True  # its handler makes no call of it (http_api._call)
        self.connections.dropped(reason)
        # aiohttp's handler sees the connection lost: a handler still reading the body is
        # cancelled, as for a client that left
        self.transport.abort()


@web.middleware
async def request_phases(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell the request's Connection when its handler starts and ends (the first middleware:
    every request the app handles passes here)."""
    transport = request.transport
    connection = transport.get_protocol() if transport is not None else None
    if not isinstance(connection, Connection):  # an app served some other way
        return await handler(request)
    connection.request_started(request)
    try:
        return await handler(request)
    finally:
        connection.request_ended(request)


class HttpServer:
    """The HTTP API of one ServingCore on --host:--http-port (a tfserve.frontends.FrontEnd).

    `shared_port`: one of --workers processes, which share the port with SO_REUSEPORT (the
    parent checked that it was free and holds it); otherwise a busy port fails the start.
    `auth`: the bearer token's check, shared with gRPC (None: one of its own, from the config).
    """

    port_field = "http_port"

    def __init__(self, core: ServingCore, ready: Readiness, shared_port: bool = False,
                 auth: BearerAuth | None = None) -> None:
        self.core = core
        self.config = core.config
        self.shared_port = shared_port
        self.app = make_app(core, ready, auth)
        add_oip_routes(self.app, core, ready)  # the Open Inference Protocol, on this port
        self.app.middlewares.insert(0, request_phases)  # frozen when the runner is set up
        self.port = 0
        self.connections: Connections | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None

    async def bind(self) -> None:
        """Listen; RuntimeError naming --http-port when the port cannot be bound. It
        answers from then on: /readyz says whether the server takes calls."""
        config = self.config
        context = ssl_context(config)
        # no aiohttp access log: every call writes the server's own (tfserve.access); the
        # handlers that remain at stop (past the drain's grace) get a second, then are cancelled
        options: dict[str, Any] = {  # each connection's RequestHandler's
            "access_log": None, "keepalive_timeout": config.http_keepalive_timeout_seconds,
            "logger": ServerLog(http_log, {})}
        runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=1.0,
                               **options)
        await runner.setup()
        server = runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        # a connection's protocol: this module's RequestHandler where aiohttp's web.Server
        # would make its own, with the same options
        connections = Connections(lambda: RequestHandler(server, loop=loop, **options),
                                  config.http_max_connections,
                                  config.http_header_timeout_seconds,
                                  config.http_body_timeout_seconds, self.core.metrics)
        try:
            # the listener aiohttp's TCPSite would open, with the Connections around its
            # protocol factory
            listener = await loop.create_server(
                connections, config.host, config.http_port, ssl=context, backlog=BACKLOG,
                reuse_port=self.shared_port or None,
                **({"ssl_handshake_timeout": config.http_header_timeout_seconds}
                   if context is not None else {}))
        except OSError as exc:
            await runner.cleanup()
            reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
            raise RuntimeError(f"--http-port {config.http_port}: cannot listen on "
                               f"{config.host}:{config.http_port}: {reason}") from None
        self._runner, self._listener, self.connections = runner, listener, connections
        self.port = int(listener.sockets[0].getsockname()[1])

    async def serve(self) -> None:
        """Nothing to do: it answers once bound, and /readyz follows the server's state."""

    async def not_serving(self) -> None:
        """Nothing to do: /readyz reads the server's state (503 while draining)."""

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening, let the handlers still running finish (or cancel them after a
        second, whatever `grace`: the drain already waited for the calls in flight), close
        the connections."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


def http_front_end(shared: Shared) -> HttpServer | None:
    """The HTTP front end, unless --http-port is 0."""
    if not shared.core.config.http_port:
        return None
    return HttpServer(shared.core, shared.ready, shared.shared_port, shared.auth)
