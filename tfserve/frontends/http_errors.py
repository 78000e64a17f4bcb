"""HTTP errors as the HTTP front ends answer them: each `Status` as an HTTP status
(`HTTP_STATUS`), the JSON error body `{"error": {"code": <Status name>, "message": ...}}`,
aiohttp's own errors (an unknown route, a wrong method, an unexpected exception) in that body
(`json_errors`), and what is wrong with a request aiohttp's parser refused, named without
any of its bytes (`malformed_reason`, `body_problem`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.http_exceptions import (
    ContentEncodingError,
    HttpProcessingError,
    InvalidURLError,
    TransferEncodingError,
)

from tfserve.serving import Status

log = logging.getLogger("tfserve.server")

HTTP_STATUS: dict[Status, int] = {
    Status.OK: 200,
    Status.INVALID_ARGUMENT: 400,
    Status.UNAUTHENTICATED: 401,
    Status.NOT_FOUND: 404,
    Status.UNIMPLEMENTED: 501,  # a route with the wrong method answers 405 (json_errors)
    Status.RESOURCE_EXHAUSTED: 429,
    Status.CANCELLED: 499,  # nobody reads it: the client left
    Status.INTERNAL: 500,
    Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 504,
}


def error_response(code: str, message: str, http_status: int,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    """The JSON error answer: {"error": {"code": ..., "message": ...}}."""
    return web.Response(body=error_json(code, message), status=http_status,
                        content_type="application/json", headers=headers)


def error_json(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}, ensure_ascii=False,
                      separators=(",", ":")).encode("utf-8")


def oip_error_response(message: str, http_status: int,
                       headers: Mapping[str, str] | None = None) -> web.Response:
    """The Open Inference Protocol's error answer, beside error_response's native one:
    `{"error": message}`, Content-Type application/json exactly (without a charset: KServe's
    client reads the error only then)."""
    body = json.dumps({"error": message}, ensure_ascii=False).encode("utf-8")
    return web.Response(body=body, status=http_status, content_type="application/json",
                        headers=headers)


# aiohttp's parse errors whose message may be the refused bytes alone (a URL, a chunk size
# line), unquoted: named by their kind instead
_UNQUOTED = {InvalidURLError: "Invalid URL", TransferEncodingError: "Invalid chunked encoding"}


def malformed_reason(exc: HttpProcessingError) -> str:
    """What is wrong with a malformed request, without any of its bytes: the first line of
    aiohttp's message, up to where it starts quoting the request (the offending line follows:
    a header with its value, a bearer token maybe).

    A message of llhttp (aiohttp's C parser) is its reason, a fixed text, then the bytes on
    lines of their own; one of aiohttp's Python code quotes them (repr) after its text, except
    for the kinds of _UNQUOTED, which are named by their kind.
    """
    for kind, name in _UNQUOTED.items():
        if isinstance(exc, kind):
            return name
    first = str(exc.message or "").split("\n", 1)[0]
    return re.split(r"""\s*(?:b?['"]|:)""", first, maxsplit=1)[0].strip()[:120] or (
        type(exc).__name__)


def body_problem(request: web.Request, exc: BaseException) -> str:
    """One line naming what is wrong with a request body whose bytes aiohttp's parser refused
    (its chunked encoding, its Content-Encoding), without any of those bytes.

    `exc`: the parser's error (tfserve.frontends.http_server ends the body with it), or
    aiohttp's RequestPayloadError raised from it.
    """
    cause = exc if isinstance(exc, HttpProcessingError) else exc.__cause__
    if isinstance(cause, ContentEncodingError):
        problem = "the request body cannot be decoded as its Content-Encoding says"
    elif "chunked" in request.headers.get("Transfer-Encoding", "").lower():
        problem = "the request body is not valid chunked encoding"
    else:
        problem = "the request body is malformed"
    if isinstance(cause, HttpProcessingError) and not isinstance(cause, TransferEncodingError):
        return f"{problem}: {malformed_reason(cause)}"  # a TransferEncodingError says no more
    return problem


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown route, wrong method) as JSON error bodies, and an
    unexpected exception as INTERNAL, never an HTML page."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 405:
            allowed = exc.headers.get("Allow", "")
            message = (f"{request.method} {request.path}: method not allowed; this route "
                       f"takes {allowed}")
        elif exc.status == 404:
            message = f"{request.method} {request.path}: no such route (GET /openapi.json " \
                      "lists them)"
        else:
            message = exc.text or exc.reason
        code = {404: Status.NOT_FOUND, 405: Status.UNIMPLEMENTED}.get(
            exc.status, Status.INVALID_ARGUMENT)
        return error_response(code.name, message, exc.status,
                              {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None)
    except ConnectionError:
        raise  # the client left: nobody to answer, and no error of the server's (aiohttp
        # drops the connection; tfserve.frontends.http_server logs it at debug level only)
    except Exception:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return error_response(Status.INTERNAL.name, "internal error", 500)
