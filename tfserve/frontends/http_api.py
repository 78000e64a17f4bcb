"""The HTTP/JSON transport of `tfserve.v1.Translator`: JSON in, the serving core, JSON out.

The bodies are the `tfserve.v1` messages in protobuf's JSON mapping (tfserve.frontends.messages,
the same conversions the gRPC front end uses; a body's `model` names the model, as over gRPC);
every call is an `HttpCall` that the core's method for its RPC runs, so the checks, the
in-flight and drain accounting, the metrics by (rpc, status) and the access log are the gRPC
side's. The routes are one table (`ROUTES`), which builds both the aiohttp application and
its OpenAPI document (tfserve.frontends.openapi).

    POST /v1/translate          TranslateRequest -> TranslateResponse        (rpc Translate)
    POST /v1/translate:stream   TranslateRequest -> server-sent events of
                                TranslateStreamResponse, then `event: done`  (TranslateStream)
    POST /v1/encode             EncodeRequest -> EncodeResponse              (Encode)
    POST /v1/detect             DetectRequest -> DetectResponse              (Detect)
    GET  /v1/model              ModelInfo of the default model               (GetModelInfo)
    GET  /v1/models             ListModelsResponse: every model, its state   (ListModels)
    GET  /v1/models/{name}      ModelInfo of that model (not loaded by it)   (GetModelInfo)
    GET  /metrics               the Prometheus exposition of the server's registry
    GET  /healthz, /v2/health/live      200 while the process serves
    GET  /readyz,  /v2/health/ready     200 when ready; 503 while starting or draining
    GET  /openapi.json          this table as OpenAPI 3
    GET  /, /static/...         the playground page (tfserve/frontends/static)

A failure is `{"error": {"code": <Status name>, "message": ...}}` with the HTTP status of
`HTTP_STATUS`; in a stream, an error after the first event is an `event: error` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    HttpProcessingError,
)
from google.protobuf.message import Message
from multidict import CIMultiDictProxy
from prometheus_client import CONTENT_TYPE_LATEST

from tfserve.frontends.front_end import Readiness
from tfserve.frontends.http_errors import (
    HTTP_STATUS,
    Handler,
    body_problem,
    error_json,
    error_response,
    json_errors,
    oip_error_response,
)
from tfserve.frontends.messages import (
    detect_input,
    detect_response,
    encode_input,
    encode_response,
    from_json,
    list_models_response,
    pb2,
    stream_response,
    to_json,
    translate_input,
    translate_response,
)
from tfserve.frontends.openapi import (
    REQUEST_ID_SCHEMA,
    Header,
    Operation,
    counting_pattern,
    openapi_document,
)
from tfserve.serving import (
    REQUEST_ID_KEY,
    Call,
    InvalidArgument,
    ModelNotFound,
    ResponseTooLarge,
    ServingCore,
    Status,
    shown,
)
from tfserve.serving.auth import REPEATED, BearerAuth
from tfserve.serving.calls import CALL_ENDED
from tfserve.serving.tracing import SERVICE

# the name prefix of the Open Inference Protocol's routes (tfserve.frontends.oip_rest adds
# them to this app): their failures are the protocol's `{"error": "<message>"}`
OIP_ROUTE_PREFIX = "oip:"
log = logging.getLogger("tfserve.server")

STATIC_DIR = Path(__file__).resolve().parent / "static"  # the playground page
STATIC_ROUTE = "/static/{name}"  # a file of STATIC_DIR (no listing, nothing below it)
TIMEOUT_HEADER = "x-request-timeout-ms"  # the call's deadline, in milliseconds from arrival
MAX_TIMEOUT_MS = 86_400_000  # one day
# the headers every call takes, as /openapi.json describes them (the limits of their checks)
CALL_HEADERS = (
    Header(REQUEST_ID_KEY, REQUEST_ID_SCHEMA,
           "the request's id, unless its body has requestId; echoed back"),
    Header(TIMEOUT_HEADER, {"type": "string", "pattern": counting_pattern(MAX_TIMEOUT_MS)},
           f"deadline in milliseconds, an integer in [1, {MAX_TIMEOUT_MS}]: "
           "DEADLINE_EXCEEDED (504) once it passes"),
)

class BodyTooLarge(ResponseTooLarge):
    """A request body over --max-message-bytes: RESOURCE_EXHAUSTED as in gRPC, answered 413."""


def request_timeout(headers: CIMultiDictProxy[str]) -> float:
    """The x-request-timeout-ms header in seconds (0.0: none), or InvalidArgument naming it."""
    values = headers.getall(TIMEOUT_HEADER, [])
    if not values:
        return 0.0
    text = values[0].strip()
    # compared by length first: int() of a string past Python's digit limit raises ValueError
    digits = text.lstrip("0") or "0"
    if len(values) > 1 or not (text.isascii() and text.isdigit()) or len(digits) > len(
            str(MAX_TIMEOUT_MS)) or not 1 <= int(digits) <= MAX_TIMEOUT_MS:
        given = "several headers" if len(values) > 1 else shown(values[0])
        raise InvalidArgument(f"{TIMEOUT_HEADER} must be one integer number of milliseconds "
                              f"in [1, {MAX_TIMEOUT_MS}], got {given}")
    return int(digits) / 1000.0


def peer_name(request: web.Request) -> str:
    """The client's address for the access log: http:HOST:PORT (http:[HOST]:PORT for IPv6)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if not peer:
        return "http:"
    host, port = peer[0], peer[1]
    return f"http:[{host}]:{port}" if ":" in host else f"http:{host}:{port}"


class HttpCall(Call):
    """A Call over an HTTP request: the id from the body or the x-request-id header, the
    deadline from x-request-timeout-ms, the request's headers as the trace context."""

    service = SERVICE  # the API its rpcs belong to (the Open Inference Protocol's: oip_rest)

    def __init__(self, core: ServingCore, rpc: str, request: web.Request,
                 message: Any = None) -> None:
        given = getattr(message, "request_id", "") or request.headers.get(REQUEST_ID_KEY, "")
        timeout_error: InvalidArgument | None = None
        try:
            seconds = request_timeout(request.headers)
        except InvalidArgument as exc:
            seconds, timeout_error = 0.0, exc
        super().__init__(core.calls, rpc, given_id=given, peer=peer_name(request),
                         time_remaining=seconds or None, invalid=timeout_error,
                         trace_carrier=request.headers,
                         trace_name=f"{request.method} {request.path}", service=self.service)
        self.received(request.content_length or 0)
        task = asyncio.current_task()
        if self.large and task is not None:
            # released once aiohttp's task for this request (the handler's frames, with the
            # message and its texts) has ended; the callback holds `freed`, not this call
            freed = self.calls.freed_memory
            task.add_done_callback(lambda _task: freed.ended())
            self.release_at_finish = False

    def span_error(self, status: Status) -> bool:
        """OpenTelemetry's rule for HTTP server spans: only a 5xx answer is an error."""
        return HTTP_STATUS[status] >= 500

    @property
    def headers(self) -> dict[str, str]:
        """The response headers every answer of this call carries."""
        return {REQUEST_ID_KEY: self.request_id}

    def sized(self, message: Message) -> bytes:
        """The message as JSON, or ResponseTooLarge past --max-message-bytes."""
        body = to_json(message)
        self.check_size(len(body))
        return body

    def error(self, exc: BaseException) -> web.Response:
        """Record the failure; its JSON answer (a call its client ended is re-raised)."""
        status, details = self.failed(exc)
        if isinstance(exc, CALL_ENDED):
            raise exc
        http_status = 413 if isinstance(exc, BodyTooLarge) else HTTP_STATUS[status]
        return error_response(status.name, details, http_status, self.headers)


async def read_message(request: web.Request, message_class: type[Message]) -> Message:
    """The request's JSON body as a message; InvalidArgument for a body that is not one
    (wrong content type, not JSON, unknown field, wrong type), BodyTooLarge past the limit."""
    if request.content_type != "application/json":
        given = request.headers.get("Content-Type")
        raise InvalidArgument("the request body must be JSON: Content-Type application/json, "
                              f"got {shown(given) if given else 'none'}")
    return from_json(await read_body(request), message_class)


async def read_body(request: web.Request) -> bytearray:
    """The request's body; BodyTooLarge past --max-message-bytes."""
    # read from the stream, not with request.read(), which keeps the body on the request:
    # aiohttp holds a keep-alive connection's last request until the next one comes, and
    # with it a body of up to --max-message-bytes long after its call ended
    limit = request.app[MAX_BODY]
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"the request body is over the server's --max-message-bytes "
                               f"of {limit} bytes")
    return body


MAX_BODY = web.AppKey("max_body", int)
# set on a request whose connection the server closed while its body was still to come
# (--http-body-timeout-seconds, tfserve.frontends.http_server): no call is made of it
BODY_DROPPED = web.RequestKey("body_dropped", bool)


async def read_call(core: ServingCore, request: web.Request, rpc: str,
                    read: Callable[[web.Request], Awaitable[Any]],
                    call_class: type[HttpCall] = HttpCall,
                    empty: Callable[[], Any] = lambda: None) -> tuple[Any, Any]:
    """A call with a body: the call (a `call_class`) and the request message `read` makes of
    the body (`empty()` for a body that is not one). Why the body is not one is the call's
    refusal (Call.refuse): raised when the core begins the call, so that it is counted and
    logged like any failed call."""
    message: Any = None
    body_error: BaseException | None = None
    try:
        message = await read(request)
    except (asyncio.CancelledError, ConnectionError):
        # the connection was lost before the body's end (the handler is cancelled with it,
        # or its read finds the body cut off): unless the server closed it for its late body
        # (not a call), the client left, and the call is CANCELLED (one access record), as
        # when it leaves later
        if request.get(BODY_DROPPED):
            raise
        body_error = asyncio.CancelledError()
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # the body's bytes break its framing: the client's error, a 400 naming it
        body_error = InvalidArgument(body_problem(request, exc))
    except Exception as exc:  # InvalidArgument, BodyTooLarge; anything else is the call's
        # INTERNAL error, logged and counted like any failed call's
        body_error = exc
    call = call_class(core, rpc, request, message)
    if body_error is not None:
        call.refuse(body_error)
        message = empty()
    return call, message


# -- the routes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """A route of the app: its documentation (`operation`) and the HttpApi method serving it."""

    operation: Operation
    handler: str


_CALL_ERRORS = (400, 401, 404, 429, 500, 503, 504)
# the JSON answers of the probes (the handlers below write them)
_LIVE = {"type": "object", "required": ["live"], "properties": {"live": {"type": "boolean"}}}
_READY = {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}}}
_MODEL_READY = {"type": "object", "required": ["name", "ready", "state"], "properties": {
    "name": {"type": "string"}, "ready": {"type": "boolean"}, "state": {"type": "string"}}}
ROUTES = (
    Route(Operation("POST", "/v1/translate", "Translate texts (or token ids)",
                    "TranslateRequest", "TranslateResponse", errors=(*_CALL_ERRORS, 413),
                    call=True),
          "translate"),
    Route(Operation("POST", "/v1/translate:stream",
                    "Translate, streaming each input's text as it is decided",
                    "TranslateRequest", "TranslateStreamResponse", content="text/event-stream",
                    errors=(*_CALL_ERRORS, 413), call=True),
          "translate_stream"),
    Route(Operation("POST", "/v1/encode", "Sentence embeddings and per-token hidden states",
                    "EncodeRequest", "EncodeResponse", errors=(*_CALL_ERRORS, 413), call=True),
          "encode"),
    Route(Operation("POST", "/v1/detect", "The language of each text (ISO 639 code, "
                    "confidence, and the model's code for it)",
                    "DetectRequest", "DetectResponse", errors=(*_CALL_ERRORS, 413), call=True),
          "detect"),
    Route(Operation("GET", "/v1/model", "The default model and the server's limits",
                    response="ModelInfo", errors=(400, 401, 404, 429, 500, 503), call=True),
          "model"),
    Route(Operation("GET", "/v1/models", "Every model of the repository and its state",
                    response="ListModelsResponse", errors=(401, 503), call=True),
          "models"),
    Route(Operation("GET", "/v1/models/{name}", "One model (described from its files, not "
                    "loaded, when it is not loaded) and the server's limits",
                    response="ModelInfo", errors=(401, 404, 500, 503), call=True),
          "named_model"),
    Route(Operation("GET", "/metrics", "Prometheus metrics of this server process",
                    content="text/plain", errors=(401,)),
          "metrics"),
    Route(Operation("GET", "/healthz", "Liveness: 200 while the process serves",
                    answer=_LIVE, secured=False), "live"),
    Route(Operation("GET", "/readyz", "Readiness: 200 when ready, 503 while starting or draining",
                    answer=_READY, secured=False, errors=(503,)), "ready"),
    Route(Operation("GET", "/v2/health/live", "Liveness (KServe v2 name)", answer=_LIVE,
                    secured=False), "live"),
    Route(Operation("GET", "/v2/health/ready", "Readiness (KServe v2 name)", answer=_READY,
                    secured=False, errors=(503,)), "ready"),
    Route(Operation("GET", "/v2/models/{name}/ready",
                    "One model's readiness (KServe v2 name): 200 while the server is ready and "
                    "the model answers or can be loaded; 503 while starting or draining, or "
                    "after its last load failed; 404 for a model not served",
                    answer=_MODEL_READY, errors=(401, 404, 503)),
          "model_ready"),
    Route(Operation("GET", "/openapi.json", "This document", answer={"type": "object"},
                    errors=(401,)), "openapi"),
)
# served without the token: the probes, and the playground page with its files
EXEMPT = frozenset({route.operation.path for route in ROUTES if not route.operation.secured}
                   | {"/", STATIC_ROUTE})


class HttpApi:
    """The handlers of ROUTES over a ServingCore. `ready` says whether the server takes calls
    ("" when it does, else why not: starting, draining)."""

    def __init__(self, core: ServingCore, ready: Readiness) -> None:
        self.core = core
        self.ready_reason = ready
        self.document = json.dumps(openapi_document(
            (route.operation for route in ROUTES), core.config, CALL_HEADERS)).encode()

    async def _call(self, request: web.Request, rpc: str, message_class: type[Message] | None
                    ) -> tuple[HttpCall, Any]:
        """The call and its request message (None without a body; an empty one for a body
        that is not one: read_call)."""
        if message_class is None:
            return HttpCall(self.core, rpc, request), None
        return await read_call(self.core, request, rpc,
                               lambda given: read_message(given, message_class),
                               HttpCall, message_class)

    async def _unary(self, request: web.Request, rpc: str,
                     message_class: type[Message] | None,
                     answer: Callable[[Any, HttpCall], Awaitable[bytes]]) -> web.Response:
        """A unary call: read the body, answer the JSON `answer` returns (the core's method
        that it calls begins the call)."""
        call, message = await self._call(request, rpc, message_class)
        try:
            body = await answer(message, call)
        except BaseException as exc:
            return call.error(exc)
        call.finish(Status.OK)
        return web.Response(body=body, content_type="application/json", headers=call.headers)

    async def translate(self, request: web.Request) -> web.Response:
        async def answer(message: Any, call: HttpCall) -> bytes:
            translations = await self.core.translate_documents(call,
                                                               translate_input(message))
            return call.sized(translate_response(translations, call.request_id))

        return await self._unary(request, "Translate", pb2.TranslateRequest, answer)

    async def encode(self, request: web.Request) -> web.Response:
        async def answer(message: Any, call: HttpCall) -> bytes:
            encodings = await self.core.encode(call, encode_input(message))
            return call.sized(encode_response(encodings, call.request_id))

        return await self._unary(request, "Encode", pb2.EncodeRequest, answer)

    async def detect(self, request: web.Request) -> web.Response:
        async def answer(message: Any, call: HttpCall) -> bytes:
            guesses = await self.core.detect(call, detect_input(message))
            return call.sized(detect_response(guesses, call.request_id))

        return await self._unary(request, "Detect", pb2.DetectRequest, answer)

    async def model(self, request: web.Request) -> web.Response:
        async def answer(message: Any, call: HttpCall) -> bytes:
            return call.sized(await self.core.model_info(call, ""))

        return await self._unary(request, "GetModelInfo", None, answer)

    async def named_model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]

        async def answer(message: Any, call: HttpCall) -> bytes:
            return call.sized(await self.core.model_info(call, name))

        return await self._unary(request, "GetModelInfo", None, answer)

    async def models(self, request: web.Request) -> web.Response:
        async def answer(message: Any, call: HttpCall) -> bytes:
            return call.sized(list_models_response(*await self.core.list_models(call)))

        return await self._unary(request, "ListModels", None, answer)

    async def translate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: `data: <TranslateStreamResponse>` per chunk, `event: done` at
        the end. The answer starts with the first chunk: whatever fails before it (the
        checks, a full queue, the drain, a deadline in the queue) is a plain JSON error with
        its HTTP status; a failure after it is an `event: error` and the end."""
        call, message = await self._call(request, "TranslateStream", pb2.TranslateRequest)
        response: web.StreamResponse | None = None
        try:
            translation = translate_input(message)
            async with aclosing(self.core.translate_stream(call, translation)) as chunks:
                async for chunk in chunks:
                    event = b"data: " + call.sized(
                        stream_response(chunk, call.request_id)) + b"\n\n"
                    if response is None:
                        response = await self._start_events(request, call)
                    await response.write(event)
            if response is None:
                response = await self._start_events(request, call)
            await response.write(b"event: done\ndata: {}\n\n")
            await response.write_eof()
        except ConnectionError:
            # the client went away while we wrote, before aiohttp cancelled this handler: a
            # cancelled call (one access record, CANCELLED), not an error of the server's.
            # Returned, not raised: aiohttp logs an exception a handler raises as an error
            # with its traceback, and a response it cannot send as a client that left
            call.failed(asyncio.CancelledError())
            return response if response is not None else web.Response(
                status=HTTP_STATUS[Status.CANCELLED])
        except BaseException as exc:
            if response is None:
                return call.error(exc)
            status, details = call.failed(exc)
            if isinstance(exc, CALL_ENDED):
                raise
            try:
                await response.write(b"event: error\ndata: " + error_json(status.name, details)
                                     + b"\n\n")
                await response.write_eof()
            except ConnectionError:  # the client left too: the failure is recorded already
                pass
            return response
        call.finish(Status.OK)
        return response

    @staticmethod
    async def _start_events(request: web.Request, call: HttpCall) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies (nginx) pass each event on at once
            **call.headers})
        await response.prepare(request)
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.core.metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        reason = self.ready_reason()
        if reason:
            return error_response(Status.UNAVAILABLE.name, reason, 503)
        return web.json_response({"ready": True})

    async def model_ready(self, request: web.Request) -> web.Response:
        """The repository's per-model health (as gRPC's `tfserve.v1.Translator/<model>`)
        under the server's own readiness."""
        name = request.match_info["name"]
        try:  # /v2/models/{name}/versions/{version}/ready too (tfserve.frontends.oip_rest)
            slot = self.core.repository.slot(name, request.match_info.get("version", ""))
        except ModelNotFound as exc:
            return error_response(Status.NOT_FOUND.name, str(exc), 404)
        reason = self.ready_reason()
        if not reason and slot.health != "SERVING":
            reason = f"model {shown(name)} is not serving: its last load failed ({slot.error})"
        if reason:
            return error_response(Status.UNAVAILABLE.name, reason, 503)
        return web.json_response({"name": slot.name, "ready": True, "state": slot.state})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self.document, content_type="application/json")

    async def index(self, request: web.Request) -> web.StreamResponse:
        page = STATIC_DIR / "index.html"
        if not page.is_file():
            return error_response(Status.NOT_FOUND.name, "no playground page in this install "
                                  f"({page} is missing)", 404)
        return web.FileResponse(page, headers={"Content-Type": "text/html; charset=utf-8"})

    async def static_file(self, request: web.Request) -> web.StreamResponse:
        """A file of the playground's directory; anything else (a file it lacks, `..`, a
        directory) is NOT_FOUND in the server's JSON, as an unknown route is."""
        path = STATIC_DIR / request.match_info["name"]
        if path.parent != STATIC_DIR or path.name.startswith(".") or not path.is_file():
            return error_response(Status.NOT_FOUND.name,
                                  f"{request.method} {request.path}: no such file", 404)
        return web.FileResponse(path)


# -- middlewares ----------------------------------------------------------------------------


def bearer_token(auth: BearerAuth) -> Callable[[web.Request, Handler],
                                                Awaitable[web.StreamResponse]]:
    """UNAUTHENTICATED (401) unless exactly one `Authorization: Bearer <token>` header
    matches; the probes and the playground page are exempt, and an unknown route stays 404.
    A refused call is counted, logged and warned about by `auth` (tfserve.serving.auth)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        match = request.match_info
        if match.http_exception is not None or match.route.resource is None or (
                match.route.resource.canonical in EXEMPT):
            return await handler(request)
        refusal = auth.check(request.headers.getall("Authorization", []))
        if not refusal:
            return await handler(request)
        auth.refused("http", refusal, f"{request.method} {match.route.resource.canonical}",
                     peer_name(request), request.headers.get(REQUEST_ID_KEY, ""))
        reason = ("more than one Authorization header" if refusal == REPEATED
                  else "missing or wrong bearer token in the Authorization header")
        challenge = {"WWW-Authenticate": "Bearer"}
        if (match.route.name or "").startswith(OIP_ROUTE_PREFIX):  # the protocol's error body
            return oip_error_response(reason, 401, challenge)
        return error_response(Status.UNAUTHENTICATED.name, reason, 401, challenge)

    return check


def make_app(core: ServingCore, ready: Readiness,
             auth: BearerAuth | None = None) -> web.Application:
    """The aiohttp application of ROUTES over `core`: bodies up to --max-message-bytes, the
    bearer token when --auth-token is set (checked by `auth`, shared with gRPC; None: one
    of its own), JSON errors."""
    middlewares: list[Any] = [json_errors]
    if core.config.auth_token:
        middlewares.append(bearer_token(auth or BearerAuth(core.config.auth_token,
                                                           core.metrics)))
    app = web.Application(client_max_size=core.config.max_message_bytes,
                          middlewares=middlewares)
    app[MAX_BODY] = core.config.max_message_bytes
    api = HttpApi(core, ready)
    for route in ROUTES:  # add_route: GET without an implicit HEAD, the table is all there is
        app.router.add_route(route.operation.method, route.operation.path,
                             getattr(api, route.handler))
    app.router.add_route("GET", "/", api.index)
    app.router.add_route("GET", STATIC_ROUTE, api.static_file)
    return app
