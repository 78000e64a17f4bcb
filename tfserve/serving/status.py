"""Call outcomes of the serving core, whatever the transport: `Status`, the errors only the
serving layer raises, and `status_for`, the one place that maps an exception to a status.

Each front end maps `Status` to its own codes in one table (the gRPC adapter to
`grpc.StatusCode`); the names are gRPC's, and they are what metrics and access logs show.
"""

from __future__ import annotations

import asyncio
import enum

from tfserve.scheduler import Cancelled, DeadlineExceeded, ModelError, QueueFull, Unavailable


class Status(enum.Enum):
    """How a call ended."""

    OK = "OK"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_FOUND = "NOT_FOUND"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"


class InvalidArgument(ValueError):
    """Bad input; the message starts with the field path."""


class Draining(Unavailable):
    """The server is shutting down."""


class ResponseTooLarge(Exception):
    """The answer is larger than --max-message-bytes (RESOURCE_EXHAUSTED, like grpc's own)."""


class ModelNotFound(LookupError):
    """The request names a model this server does not serve (NOT_FOUND); the message names
    the models it does serve."""


class ModelCapacity(Exception):
    """A model cannot be loaded now: --max-loaded-models or --max-model-memory is reached
    and every loaded model has requests in flight, or the model alone is over
    --max-model-memory (RESOURCE_EXHAUSTED)."""


class ModelLoadFailed(Exception):
    """A model's artifacts could not be loaded (INTERNAL; the message has the reason)."""


def status_for(exc: BaseException) -> tuple[Status, str]:
    """The one place that maps an exception to a status and its message."""
    if isinstance(exc, InvalidArgument):
        return Status.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ModelNotFound):
        return Status.NOT_FOUND, str(exc)
    if isinstance(exc, (QueueFull, ResponseTooLarge, ModelCapacity)):
        return Status.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unavailable):
        return Status.UNAVAILABLE, str(exc)
    if isinstance(exc, DeadlineExceeded):
        return Status.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, (Cancelled, asyncio.CancelledError)):
        return Status.CANCELLED, str(exc) or "request cancelled"
    if isinstance(exc, (ModelError, ModelLoadFailed)):
        return Status.INTERNAL, str(exc)
    return Status.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
