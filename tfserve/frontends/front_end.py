"""What a server process needs from each of its front ends (`FrontEnd`), and what the front
ends of one process share (`Shared`).

The process (tfserve.server.translator_server) builds its front ends from one list of
factories (`FrontEndFactory`: a `Shared` -> the front end, or None when the settings turn it
off), then runs the same steps over all of them:

    start:  bind() each, in the list's order (a busy port fails the start here, before
            anything runs that would need stopping) -> the core starts -> serve() each
    drain:  the core refuses new calls -> not_serving() each -> the calls in flight end
            (within --grace-seconds) -> stop(grace) each, in the reverse order
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tfserve.serving import ServingCore
from tfserve.serving.auth import BearerAuth

Readiness = Callable[[], str]  # "" when the server takes calls, else why not


@dataclass(frozen=True)
class Shared:
    """What the front ends of one server process share: the core; the server's readiness
    (starting, serving, draining); the bearer token's one check, so that its refusals are
    counted and warned about once for every transport (None: --auth-token is not set); and
    whether the ports are shared with the other --workers processes (SO_REUSEPORT)."""

    core: ServingCore
    ready: Readiness
    auth: BearerAuth | None = None
    shared_port: bool = False


class FrontEnd(Protocol):
    """One wire format on one listener, over the core: it converts its requests into the
    core's plain values, calls the core's method for each RPC and renders the result."""

    # the field that names its bound port in the server's `serving` log record ("port" for
    # gRPC, "http_port" for HTTP), and that port once bound (the one picked, for port 0)
    port_field: str
    port: int

    async def bind(self) -> None:
        """Listen; RuntimeError naming the port's flag when it cannot."""

    async def serve(self) -> None:
        """Take calls: every front end is bound and the core has started."""

    async def not_serving(self) -> None:
        """The drain's first step: the health this front end reports says it is not
        serving (the core refuses the new calls)."""

    async def stop(self, grace: float | None) -> None:
        """Stop listening and end its connections; calls still running get `grace` seconds
        (None: until they end)."""


FrontEndFactory = Callable[[Shared], "FrontEnd | None"]  # None: off under the settings
