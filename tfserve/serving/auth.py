"""Bearer-token authentication (--auth-token, --auth-token-file), for both front ends.

`BearerAuth.check` compares the `authorization` values a call sent with the token in constant
time; each front end answers a refusal in its own way (gRPC UNAUTHENTICATED, HTTP 401) and
calls `refused`, which leaves the same traces on both transports: a count
(tfserve_auth_failures_total{transport, reason}), one access-log record (status
UNAUTHENTICATED) and a warning at most once per `interval` seconds, which counts the refusals
since the previous one. None of them holds what the client sent in `authorization`: neither
the token nor a part of it.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from tfserve.serving.requests import check_request_id
from tfserve.serving.status import InvalidArgument, Status
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.server")
access_log = logging.getLogger("tfserve.access")

# why a call was refused (the label `reason`)
MISSING, WRONG, REPEATED = "missing", "wrong", "repeated"
WARNING_INTERVAL = 60.0  # seconds between two warnings about refused calls


class BearerAuth:
    """The server's bearer token and the record of the calls refused for it.

    `metrics`: the server's Metrics (its `auth_failures` counter); `clock` and `interval`: when
    the next warning may be written (a test injects its own clock).
    """

    def __init__(self, token: str, metrics: Metrics, clock: Callable[[], float] = time.monotonic,
                 interval: float = WARNING_INTERVAL) -> None:
        self.expected = f"Bearer {token}".encode()
        self.metrics = metrics
        self.clock = clock
        self.interval = interval
        self._last_warning: float | None = None
        self._unreported = 0  # refusals since the last warning

    def check(self, given: Sequence[str | bytes]) -> str:
        """"" when `given` (every `authorization` value of the call) is exactly one value
        equal to `Bearer <token>`; else why not: MISSING, WRONG or REPEATED. More than one
        value is refused whatever they hold: which one a proxy or a framework reads is not
        ours to guess."""
        if not given:
            return MISSING
        if len(given) > 1:
            return REPEATED
        value = given[0]
        if isinstance(value, str):
            value = value.encode("utf-8", "surrogateescape")
        return "" if hmac.compare_digest(bytes(value), self.expected) else WRONG

    def refused(self, transport: str, reason: str, rpc: str, peer: str,
                given_id: str = "") -> None:
        """Count a refused call, write its access record, and warn unless a warning was written
        less than `interval` seconds ago (the next one counts this refusal too).

        `rpc`: the method (gRPC) or the route (HTTP, `POST /v1/translate`) it asked for;
        `given_id`: the x-request-id it sent, if any (a generated id otherwise, or when that
        one is not a valid id).
        """
        self.metrics.auth_failures.labels(transport, reason).inc()
        request_id = uuid.uuid4().hex
        if given_id:
            try:
                request_id = check_request_id(given_id)
            except InvalidArgument:
                pass
        if access_log.isEnabledFor(logging.INFO):
            # the shape of every access record (tfserve.serving.calls.Call.finish)
            access_log.info("request", extra={"fields": {
                "request_id": request_id, "rpc": rpc, "status": Status.UNAUTHENTICATED.name,
                "texts": 0, "tokens": 0, "queue_ms": 0.0, "total_ms": 0.0, "peer": peer,
                "error": f"{reason} bearer token"}})
        self._unreported += 1
        now = self.clock()
        if self._last_warning is not None and now - self._last_warning < self.interval:
            return
        log.warning("calls refused for their bearer token", extra={"fields": {
            "event": "auth_failed", "refused": self._unreported, "transport": transport,
            "reason": reason, "rpc": rpc, "peer": peer}})
        self._last_warning, self._unreported = now, 0
