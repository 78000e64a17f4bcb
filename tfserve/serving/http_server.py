"""The HTTP listener around the HTTP API (tfserve.serving.http_api): an aiohttp runner on the
server's own event loop (asyncio or uvloop, the one gRPC runs on), TLS from the same
certificate, key and client CA as gRPC, and its start / stop steps.

The handlers are cancelled when their client disconnects (aiohttp's handler_cancellation),
which cancels the call's work as a cancelled gRPC call does: its rows leave the batch before
the next decoder step.
"""

from __future__ import annotations

import logging
import os
import ssl

from aiohttp import web

from tfserve.serving.core import ServingCore
from tfserve.serving.http_api import Readiness, make_app
from tfserve.settings import ServerConfig

log = logging.getLogger("tfserve.server")


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


class HttpServer:
    """The HTTP API of one ServingCore on --host:--http-port.

    `shared_port`: one of --workers processes, which share the port with SO_REUSEPORT (the
    parent checked that it was free and holds it); otherwise a busy port fails the start.
    """

    def __init__(self, core: ServingCore, ready: Readiness, shared_port: bool = False) -> None:
        self.core = core
        self.config = core.config
        self.shared_port = shared_port
        self.app = make_app(core, ready)
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen; RuntimeError naming --http-port when the port cannot be bound."""
        config = self.config
        context = ssl_context(config)
        # no aiohttp access log: every call writes the server's own (tfserve.access); the
        # handlers that remain at stop (past the drain's grace) get a second, then are cancelled
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.http_port, ssl_context=context,
                           reuse_port=self.shared_port or None)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
            raise RuntimeError(f"--http-port {config.http_port}: cannot listen on "
                               f"{config.host}:{config.http_port}: {reason}") from None
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop listening, let the handlers still running finish (or cancel them after a
        second: the drain already waited for the calls in flight), close the connections."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
