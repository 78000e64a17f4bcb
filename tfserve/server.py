"""The gRPC server: `python -m tfserve serve --model DIR --port 50051` (docs/server.md).

Three layers that never reach past each other:

    TranslatorService  (transport: protobuf in/out, input checks, statuses)   this module
    -> Scheduler       (queue, dynamic + continuous batching, worker thread)  tfserve.scheduler
    -> Runtime         (ONNX Runtime sessions)                                tfserve.runtime

grpc.aio runs every RPC on one event loop; the model only ever runs on the scheduler's worker
thread, and results come back through futures. Around every RPC, one helper (`_Call`) checks
that the server is still serving, echoes the request id, counts the RPC in the metrics, writes
one access-log line, and turns exceptions into statuses (`status_for`).

Shutdown (SIGTERM / SIGINT): health goes NOT_SERVING, new RPCs get UNAVAILABLE, RPCs in flight
finish within --grace-seconds, then the server stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hmac
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tfserve.generation import DecodingOptions, Hypothesis
from tfserve.metrics import Metrics
from tfserve.proto import load as load_stubs
from tfserve.scheduler import (
    Cancelled,
    DeadlineExceeded,
    Job,
    ModelError,
    QueueFull,
    Scheduler,
    StreamEvent,
    Unavailable,
)
from tfserve.settings import ServerConfig, env_name, parse_config  # noqa: F401 (re-exported)
from tfserve.translator import POOLINGS, check_texts, tokenize_sources
from tfserve.version import __version__

pb2, pb2_grpc = load_stubs()
SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Translator"].full_name  # tfserve.v1.Translator
REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_CHARS = 128  # echoed in metadata and logs: short, printable ASCII only
INLINE_TOKENIZE_CHARS = 4096  # larger requests are tokenized on a thread, off the event loop
EXIT_USAGE = 2

log = logging.getLogger("tfserve.server")
access_log = logging.getLogger("tfserve.access")


# -- errors -> statuses ---------------------------------------------------------------------


class InvalidArgument(ValueError):
    """Bad input; the message starts with the field path."""


@contextmanager
def field_errors(prefix: str = "") -> Any:
    """Turn the ValueErrors of the shared input checks into InvalidArgument, field-prefixed."""
    try:
        yield
    except InvalidArgument:
        raise
    except ValueError as exc:
        raise InvalidArgument(f"{prefix}{exc}") from exc


class Draining(Unavailable):
    """The server is shutting down."""


class ResponseTooLarge(Exception):
    """The answer is larger than --max-message-bytes (RESOURCE_EXHAUSTED, like grpc's own)."""


def shown(value: str, limit: int = 40) -> str:
    """A client's string for an error message or a log: repr, cut to `limit` characters."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def check_request_id(value: str) -> str:
    """The request id as given, or InvalidArgument: it is echoed in response metadata, which
    takes printable ASCII only, and in every log line, so it is short."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id is {len(value)} characters, over the limit of "
                              f"{MAX_REQUEST_ID_CHARS}")
    if not all(" " <= char <= "~" for char in value):
        raise InvalidArgument(f"request_id {shown(value)} must be printable ASCII "
                              "(no control characters, no non-ASCII)")
    return value


class Malformed:
    """Stands for a request message that did not parse, so that the call is answered
    INVALID_ARGUMENT through the usual path (logged, counted) instead of grpc's UNKNOWN."""

    def __init__(self, message_name: str, error: BaseException) -> None:
        self.message_name = message_name
        self.error = error

    def invalid(self) -> InvalidArgument:
        return InvalidArgument(f"the request is not a valid {self.message_name} message "
                               f"({type(self.error).__name__}: {str(self.error)[:200]})")


def lenient_parser(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that returns Malformed instead of raising."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(name, exc)

    return parse


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that maps an exception to a gRPC status and its details."""
    if isinstance(exc, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (QueueFull, ResponseTooLarge)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, (Cancelled, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED, str(exc) or "request cancelled"
    if isinstance(exc, ModelError):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


# -- per-call bookkeeping -------------------------------------------------------------------


class _Call:
    """One RPC: request id, deadline, in-flight count, metrics, access log, error status."""

    def __init__(self, server: TranslatorServer, rpc: str, request: Any,
                 context: grpc.aio.ServicerContext, streaming: bool = False) -> None:
        self.server = server
        self.rpc = rpc
        self.streaming = streaming
        self.context = context
        self.started = time.perf_counter()
        self.job: Job | None = None
        self.texts = 0
        # read now: once the call has ended (a cancelled stream), grpc's context must not be
        # asked for anything (context.peer() then crashed the process)
        self.peer = context.peer()
        self.invalid: InvalidArgument | None = (
            request.invalid() if isinstance(request, Malformed) else None)
        given = getattr(request, "request_id", "") or (
            dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY) or "")
        self.request_id = uuid.uuid4().hex
        if given:
            try:
                self.request_id = check_request_id(str(given))
            except InvalidArgument as exc:
                self.invalid = self.invalid or exc
        self.metadata_sent = False
        remaining = context.time_remaining()
        # None (or, in some grpc versions, a huge value) when the client set no deadline
        self.deadline = (time.monotonic() + remaining
                         if remaining is not None and remaining < 1e8 else None)

    def begin(self) -> None:
        self.server._call_started()
        if self.server.draining:
            raise Draining("the server is shutting down; retry on another replica")
        if self.invalid is not None:
            raise self.invalid

    def check_size(self, message: Any) -> Any:
        """The message, or ResponseTooLarge when grpc would refuse to send it: then the
        failure is logged and counted as what the client sees."""
        limit = self.server.config.max_message_bytes
        size = message.ByteSize()
        if size > limit:
            raise ResponseTooLarge(f"the response is {size} bytes, over the server's "
                                   f"--max-message-bytes of {limit}; ask for fewer texts or "
                                   "without hidden states")
        return message

    async def send_metadata(self) -> None:
        """Echo the request id in the response metadata (once).

        A stream sends it in its headers, after the request is queued (the headers are a
        write of their own, and done first they would delay the model by a trip through the
        event loop). A unary call sends it in the trailers, which go out with the status: an
        early header write cost the event loop 0.23 ms per request, 12% of its time at 32
        demo clients. (So a unary call that the client's deadline or cancellation ends, which
        gRPC closes without us, carries no id: clients correlate those by their own id.)
        """
        if not self.metadata_sent:
            self.metadata_sent = True
            metadata = ((REQUEST_ID_KEY, self.request_id),)
            if self.streaming:
                await self.context.send_initial_metadata(metadata)
            else:
                self.context.set_trailing_metadata(metadata)

    async def wait(self, job: Job) -> list[Any]:
        """The job's results; when the RPC is cancelled, the job is cancelled with it.

        The worker thread settles a future of this loop directly (one call_soon_threadsafe
        per request). Unlike asyncio.wrap_future, cancelling the RPC does not cancel the
        job's future, so fail() can still record why (deadline or cancelled).
        """
        self.job = job
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[list[Any]] = loop.create_future()
        job.future.add_done_callback(
            lambda done: loop.call_soon_threadsafe(_settle, waiter, done))
        await self.send_metadata()
        return await waiter

    def expired(self) -> bool:
        """Whether the client's deadline has passed (grpc cancels the RPC right at it).

        From our own copy of the deadline: the call may be over, and grpc's context must not
        be used then. Ours was taken a moment after grpc's own: allow for the difference.
        """
        return self.deadline is not None and time.monotonic() >= self.deadline - 0.05

    async def fail(self, exc: BaseException) -> NoReturn:
        """Record the failure, then abort with its status (or re-raise a cancellation)."""
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            # the client went away or its deadline passed: free the rows before the next step
            reason = "deadline" if self.expired() else "cancelled"
            if self.job is not None:
                self.job.cancel(reason)
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if reason == "deadline"
                    else grpc.StatusCode.CANCELLED)
            self.finish(code, reason)
            raise exc
        code, details = status_for(exc)
        if code == grpc.StatusCode.INTERNAL and not isinstance(exc, ModelError):
            log.error("%s %s failed", self.rpc, self.request_id, exc_info=exc)
        if self.job is not None:
            self.job.cancel()  # a failure outside the scheduler: stop its work too
        self.finish(code, details)
        await self.send_metadata()
        await self.context.abort(code, details)
        raise AssertionError("unreachable: abort raises")

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        elapsed = time.perf_counter() - self.started
        self.server._call_finished(self.rpc, code, elapsed)
        if not access_log.isEnabledFor(logging.INFO):
            return
        record: dict[str, Any] = {
            "request_id": self.request_id,
            "rpc": self.rpc,
            "status": code.name,
            "texts": self.texts,
            "tokens": self.job.generated_tokens if self.job else 0,
            "queue_ms": round(self.job.queue_seconds * 1000, 3) if self.job else 0.0,
            "total_ms": round(elapsed * 1000, 3),
            "peer": self.peer,
        }
        if details and code != grpc.StatusCode.OK:
            record["error"] = details
        access_log.info("request", extra={"fields": record})


def _settle(waiter: asyncio.Future[Any], done: concurrent.futures.Future[Any]) -> None:
    """On the event loop: pass a job's outcome on to the RPC awaiting it (unless it left)."""
    if waiter.done():  # the RPC was cancelled meanwhile
        return
    if done.cancelled():
        waiter.set_exception(Cancelled("request cancelled"))
    elif done.exception() is not None:
        waiter.set_exception(done.exception())  # type: ignore[arg-type]
    else:
        waiter.set_result(done.result())


Handler = Callable[..., Awaitable[Any]]


def unary(rpc: str) -> Callable[[Handler], Handler]:
    """Wrap a unary servicer method `(self, request, context, call) -> response`."""

    def wrap(method: Handler) -> Handler:
        async def handler(self: TranslatorService, request: Any,
                          context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self.server, rpc, request, context)
            try:
                call.begin()
                response = await method(self, request, context, call)
                await call.send_metadata()
            except BaseException as exc:
                await call.fail(exc)
            call.finish(grpc.StatusCode.OK)
            return response

        handler.__name__ = method.__name__
        return handler

    return wrap


def streaming(rpc: str) -> Callable[[Callable[..., AsyncIterator[Any]]],
                                    Callable[..., AsyncIterator[Any]]]:
    """Wrap a server-streaming servicer method (an async generator) the same way."""

    def wrap(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def handler(self: TranslatorService, request: Any,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self.server, rpc, request, context, streaming=True)
            try:
                call.begin()
                async for chunk in method(self, request, context, call):
                    await call.send_metadata()
                    yield chunk
                await call.send_metadata()
            except BaseException as exc:
                await call.fail(exc)
            call.finish(grpc.StatusCode.OK)

        handler.__name__ = method.__name__
        return handler

    return wrap


# -- request parsing ------------------------------------------------------------------------


def decoding_options_from_proto(message: Any, default_max_new_tokens: int) -> DecodingOptions:
    """proto DecodingOptions -> generation.DecodingOptions (zero / unset: server default)."""
    return DecodingOptions(
        max_new_tokens=message.max_new_tokens or default_max_new_tokens or None,
        min_new_tokens=message.min_new_tokens,
        num_beams=message.num_beams or 1,
        length_penalty=(message.length_penalty if message.HasField("length_penalty") else 1.0),
        early_stopping=message.early_stopping,
        num_return_sequences=message.num_return_sequences or 1,
        do_sample=message.do_sample,
        temperature=message.temperature if message.HasField("temperature") else 1.0,
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        seed=message.seed if message.HasField("seed") else None,
    )


class _TextDelta:
    """Turns the tokens of one streamed input into text deltas that add up to its final text.

    SentencePiece text is decoded from the whole token prefix each time (a piece's leading
    '▁' becomes a space only after another piece), and a trailing U+FFFD (a byte-fallback
    character not yet complete) is held back until the next token completes it. Tokens that
    add no text yet wait in `unsent` and go out with the next chunk that has text.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.unsent: list[int] = []
        self.text = ""

    def take_unsent(self) -> list[int]:
        """The tokens pushed since the last chunk (they go out with the next one)."""
        tokens, self.unsent = self.unsent, []
        return tokens

    def push(self, token_ids: list[int]) -> str:
        self.tokens.extend(token_ids)
        self.unsent.extend(token_ids)
        full = self.decode(self.tokens)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta

    def finish(self, final: Hypothesis, final_text: str) -> tuple[list[int], str]:
        """(token ids not sent yet, the rest of the text) for the last chunk."""
        sent = len(self.tokens)
        new_tokens = (final.token_ids[sent:] if final.token_ids[:sent] == self.tokens
                      else list(final.token_ids))
        if not final_text.startswith(self.text):  # never seen; the deltas would not add up
            log.warning("streamed text %r is not a prefix of the final %r", self.text,
                        final_text)
            return new_tokens, final_text
        return new_tokens, final_text[len(self.text):]


# -- the service ----------------------------------------------------------------------------


class TranslatorService(pb2_grpc.TranslatorServicer):
    """tfserve.v1.Translator over a Scheduler; see proto/tfserve/v1/translator.proto."""

    def __init__(self, server: TranslatorServer) -> None:
        self.server = server
        self.runtime = server.runtime
        self.tokenizer = server.runtime.tokenizer
        self.config = server.config
        self.scheduler = server.scheduler
        self.max_source_tokens = int(server.runtime.max_source_positions)
        self.vocab_size = int(server.runtime.vocab_size)

    # -- input ------------------------------------------------------------------------------

    async def _sources(self, request: Any, call: _Call) -> list[list[int]]:
        """Token ids per input from texts or token_ids, with the shared checks."""
        limit = self.config.max_texts_per_request
        if len(request.texts) and len(request.token_ids):
            raise InvalidArgument("texts and token_ids are mutually exclusive: give one")
        if len(request.token_ids):
            call.texts = len(request.token_ids)
            return self._token_sources(request.token_ids, request.truncate, limit)
        call.texts = len(request.texts)
        return await self._tokenize(list(request.texts), request.truncate)

    async def _tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        """check_texts + tokenize_sources; large requests are tokenized off the event loop,
        so that they do not stall every other call."""
        with field_errors():
            texts = check_texts(texts, max_texts=self.config.max_texts_per_request)
            args = (self.tokenizer, texts, self.max_source_tokens, truncate)
            if sum(len(text) for text in texts) <= INLINE_TOKENIZE_CHARS:
                return tokenize_sources(*args)
            return await asyncio.to_thread(tokenize_sources, *args)

    def _token_sources(self, sequences: Sequence[Any], truncate: bool,
                       limit: int) -> list[list[int]]:
        if len(sequences) > limit:
            raise InvalidArgument(f"token_ids holds {len(sequences)} items, over the limit of "
                                  f"{limit}")
        eos = self.tokenizer.eos_id
        sources = []
        for index, sequence in enumerate(sequences):
            ids = [int(i) for i in sequence.ids]
            if not ids:
                raise InvalidArgument(f"token_ids[{index}] is empty")
            for position, token in enumerate(ids):
                if not 0 <= token < self.vocab_size:
                    raise InvalidArgument(f"token_ids[{index}].ids[{position}] is {token}, "
                                          f"outside the vocabulary [0, {self.vocab_size})")
            if ids[-1] != eos:
                ids.append(eos)
            if len(ids) > self.max_source_tokens:
                if not truncate:
                    raise InvalidArgument(
                        f"token_ids[{index}] is {len(ids)} tokens, over the limit of "
                        f"{self.max_source_tokens} source tokens (truncate=true cuts it)")
                ids = ids[: self.max_source_tokens - 1] + [eos]
            sources.append(ids)
        return sources

    def _options(self, message: Any) -> DecodingOptions:
        with field_errors("options."):
            options = decoding_options_from_proto(message, self.config.default_max_new_tokens)
            return options.validate(max_new_tokens_limit=self.scheduler.max_new_tokens_limit)

    async def _submit_translate(self, request: Any, call: _Call,
                                on_event: Callable[[StreamEvent], None] | None = None) -> Job:
        sources = await self._sources(request, call)
        options = self._options(request.options)
        with field_errors("options."):
            return self.scheduler.submit_translate(sources, options, deadline=call.deadline,
                                                   on_event=on_event)

    def _hypothesis(self, hypothesis: Hypothesis, text: str | None = None) -> Any:
        if text is None:
            text = self.tokenizer.decode(hypothesis.token_ids)
        return pb2.Hypothesis(text=text, token_ids=hypothesis.token_ids,
                              score=hypothesis.score)

    # -- rpcs -------------------------------------------------------------------------------

    @unary("Translate")
    async def Translate(self, request: Any, context: grpc.aio.ServicerContext,
                        call: _Call) -> Any:
        results = await call.wait(await self._submit_translate(request, call))
        return call.check_size(pb2.TranslateResponse(
            request_id=call.request_id,
            translations=[pb2.Translation(hypotheses=[self._hypothesis(h) for h in hyps])
                          for hyps in results]))

    @streaming("TranslateStream")
    async def TranslateStream(self, request: Any, context: grpc.aio.ServicerContext,
                              call: _Call) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()

        def on_event(event: StreamEvent) -> None:  # worker thread: hand off only
            loop.call_soon_threadsafe(events.put_nowait, event)

        job = await self._submit_translate(request, call, on_event)
        call.job = job
        await call.send_metadata()
        # the job's end (success or failure) arrives after its last event: both go through
        # call_soon_threadsafe from the worker thread, which keeps their order
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        deltas: dict[int, _TextDelta] = {}
        while True:
            event = await events.get()
            if event is None:
                break
            delta = deltas.setdefault(event.index, _TextDelta(self.tokenizer.decode))
            if not event.done:
                text = delta.push(event.token_ids)
                if text:  # a chunk only when there is text (the tokens ride along with it)
                    yield call.check_size(pb2.TranslateStreamResponse(
                        index=event.index, request_id=call.request_id, text_delta=text,
                        token_ids=delta.take_unsent()))
                continue
            assert event.hypotheses is not None
            head = delta.push(event.token_ids)  # the last step's token, when it was not eos
            best = event.hypotheses[0]
            best_text = self.tokenizer.decode(best.token_ids)
            new_tokens, rest = delta.finish(best, best_text)
            chunk = pb2.TranslateStreamResponse(
                index=event.index, request_id=call.request_id, done=True,
                text_delta=head + rest, token_ids=delta.take_unsent() + new_tokens,
                final=self._hypothesis(best, best_text))
            if len(event.hypotheses) > 1:
                chunk.hypotheses.extend(self._hypothesis(h) for h in event.hypotheses)
            yield call.check_size(chunk)
        await call.wait(job)  # raises the job's error, if it failed

    @unary("Encode")
    async def Encode(self, request: Any, context: grpc.aio.ServicerContext, call: _Call) -> Any:
        call.texts = len(request.texts)
        pooling = request.pooling or "mean"
        if pooling not in POOLINGS:
            raise InvalidArgument(f"pooling must be one of {', '.join(POOLINGS)}, "
                                  f"got {shown(pooling)}")
        sources = await self._tokenize(list(request.texts), request.truncate)
        with field_errors():
            job = self.scheduler.submit_encode(sources, pooling, request.return_hidden_states,
                                               deadline=call.deadline)
        results = await call.wait(job)
        embeddings = []
        for encoded in results:
            message = pb2.Embedding(embedding=encoded.embedding.tolist(),
                                    num_tokens=len(encoded.token_ids),
                                    dim=int(encoded.embedding.shape[-1]),
                                    token_ids=encoded.token_ids)
            if encoded.hidden_states is not None:
                message.hidden_states.extend(encoded.hidden_states.ravel().tolist())  # [len*D]
            embeddings.append(message)
        return call.check_size(pb2.EncodeResponse(embeddings=embeddings,
                                                  request_id=call.request_id))

    @unary("GetModelInfo")
    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext,
                           call: _Call) -> Any:
        return self.server.model_info()


def add_translator_service(service: TranslatorService, server: grpc.aio.Server) -> None:
    """Register the service as the generated add_TranslatorServicer_to_server does, but with
    lenient request parsers (Malformed instead of grpc's UNKNOWN for a message that does not
    parse)."""
    descriptor = pb2.DESCRIPTOR.services_by_name["Translator"]
    handlers = {}
    for method in descriptor.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=lenient_parser(request_class),
                                     response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


# -- auth -----------------------------------------------------------------------------------


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


# -- the server -----------------------------------------------------------------------------


class TranslatorServer:
    """Model + scheduler + grpc.aio server + health + reflection + metrics endpoint.

    `await start()` binds and serves; `await drain()` is the SIGTERM path. `runtime` is any
    object with Runtime's interface (Backend + .tokenizer, .config, .manifest).
    """

    def __init__(self, config: ServerConfig, runtime: Any | None = None,
                 metrics: Metrics | None = None, worker: int | None = None) -> None:
        self.config = config.validate()
        # one of --workers processes (tfserve.workers): it shares the port with the others
        self.worker = worker
        if runtime is None:
            runtime = load_runtime(config)
        self.runtime = runtime
        limit = runtime.max_target_positions - 1
        if config.default_max_new_tokens > limit:
            raise ValueError(f"--default-max-new-tokens {config.default_max_new_tokens} is over "
                             f"the model's limit of {limit} new tokens")
        self.metrics = metrics or Metrics()
        self.scheduler = Scheduler(runtime, config.scheduler_config(), self.metrics)
        self.health = health.aio.HealthServicer()
        self.draining = False
        self.in_flight = 0
        self._rpc_metrics: dict[tuple[str, grpc.StatusCode], tuple[Any, Any]] = {}
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._idle: asyncio.Event | None = None

    # in-flight accounting (event-loop thread only)
    def _call_started(self) -> None:
        self.in_flight += 1
        self.metrics.in_flight.inc()
        if self._idle is not None:
            self._idle.clear()

    def _call_finished(self, rpc: str, code: grpc.StatusCode, seconds: float) -> None:
        metrics = self._rpc_metrics.get((rpc, code))
        if metrics is None:  # labelled children, looked up once per (rpc, code)
            metrics = self._rpc_metrics[(rpc, code)] = (
                self.metrics.requests.labels(rpc, code.name),
                self.metrics.request_seconds.labels(rpc))
        metrics[0].inc()
        metrics[1].observe(seconds)
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def start(self) -> None:
        config = self.config
        self._idle = asyncio.Event()
        self._idle.set()
        # the metrics port first: a busy one then fails before anything runs that would need
        # stopping (a started gRPC server outliving its event loop)
        if config.metrics_port:
            self.metrics_port = self.metrics.serve_http(config.metrics_port,
                                                        config.metrics_bind_host())
        options = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            # a second server on a busy port must fail, not silently share it; the workers of
            # one `--workers N` server share theirs (the parent checked that it was free)
            ("grpc.so_reuseport", 0 if self.worker is None else 1),
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
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        server = grpc.aio.server(options=options, interceptors=interceptors)
        add_translator_service(TranslatorService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"[{config.host}]:{config.port}" if ":" in config.host else (
            f"{config.host}:{config.port}")
        try:
            if config.tls_cert is not None and config.tls_key is not None:
                client_ca = config.tls_client_ca
                credentials = grpc.ssl_server_credentials(
                    [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                    root_certificates=client_ca.read_bytes() if client_ca else None,
                    require_client_auth=client_ca is not None)
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc's "failed to bind" in newer versions
            self.port = 0
        if self.port == 0:
            self.metrics.close()
            raise RuntimeError(f"--port {config.port}: cannot listen on {address}")
        self.scheduler.start()  # once the port is ours: nothing to stop if it is not
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
        self.draining = True
        self.scheduler.close()
        await self.health.enter_graceful_shutdown()
        log.info("draining", extra={"fields": {"event": "draining", "in_flight": self.in_flight,
                                               "grace_seconds": grace}})
        assert self._idle is not None
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace)
        except asyncio.TimeoutError:
            log.warning("grace period over with %d request(s) in flight", self.in_flight)
        if self._server is not None:
            # what is left are health watches and reflection streams, or RPCs past the grace
            await self._server.stop(min(max(deadline - loop.time(), 0.0), 1.0))
        await asyncio.to_thread(self.scheduler.stop)  # joins the worker: off the loop
        self.metrics.close()
        log.info("stopped", extra={"fields": {"event": "stopped"}})

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def model_info(self) -> Any:
        runtime, config = self.runtime, self.runtime.config
        manifest = runtime.manifest
        parity = dict(manifest.parity or {})
        describe = runtime.describe()
        return pb2.ModelInfo(
            model_name=config.name,
            source_language=config.source_language,
            target_language=config.target_language,
            max_source_tokens=config.max_source_positions,
            max_target_tokens=config.max_target_positions,
            vocab_size=config.vocab_size,
            d_model=config.d_model,
            encoder_layers=config.encoder_layers,
            decoder_layers=config.decoder_layers,
            num_heads=config.num_heads,
            positions=config.positions,
            dtype=manifest.dtype,
            quantization=manifest.quantization or "",
            limits=pb2.Limits(
                max_texts_per_request=self.config.max_texts_per_request,
                max_batch_size=self.config.max_batch_size,
                max_batch_tokens=self.config.max_batch_tokens,
                max_queue=self.config.max_queue,
                max_message_bytes=self.config.max_message_bytes,
                default_max_new_tokens=(self.config.default_max_new_tokens
                                        or DecodingOptions().validate(
                                            self.scheduler.max_new_tokens_limit).max_new_tokens),
                max_beams=DecodingOptions.MAX_BEAMS,
            ),
            device=describe.get("device", self.config.device),
            providers=describe.get("providers", []),
            tfserve_version=__version__,
            parity=pb2.ParitySummary(
                passed=bool(parity.get("passed", False)),
                max_abs_logits_diff=float(parity.get("max_abs_diff", {}).get("max_logits", 0.0)),
                greedy_agreement=float(parity.get("greedy", {}).get("agreement", 0.0)),
                precision=str(parity.get("precision", "")),
                device=str(parity.get("device", "")),
                report_json=json.dumps(parity, sort_keys=True),
            ),
        )


def load_runtime(config: ServerConfig) -> Any:
    from tfserve.runtime import Runtime

    model = config.model
    if model is None:
        from tfserve.demo import default_artifacts

        model = default_artifacts()
    return Runtime(model, device=config.device, intra_op_threads=config.threads)


# -- logging --------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        line = f"{self.formatTime(record)} {record.levelname.lower()} {record.name} " \
               f"{record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger("tfserve")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


# -- entry point ----------------------------------------------------------------------------


async def serve(config: ServerConfig, runtime: Any | None = None, worker: int | None = None,
                on_serving: Callable[[], None] | None = None) -> int:
    """Run until SIGTERM / SIGINT, then drain; returns the exit code. on_serving is called
    once the server listens (a worker tells its parent that it started)."""
    server = TranslatorServer(config, runtime, worker=worker)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before start: a signal then still drains
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    if on_serving is not None:
        on_serving()
    await stop.wait()
    drain = asyncio.ensure_future(server.drain())
    # a second signal during the drain stops at once
    stop.clear()
    forced = asyncio.ensure_future(stop.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.warning("second signal: stopping without waiting for requests in flight")
        drain.cancel()
        if server._server is not None:
            await server._server.stop(0)
        server.scheduler.stop()
    forced.cancel()
    return 0


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of handing it back to the kernel.

    The decoding loop allocates cache-sized arrays (tens of MB) at every join and row
    reorder. By default glibc serves those with fresh mmap pages and returns them when freed,
    so every join paid the page faults again: a 32-row join of an opus-mt-base-sized model
    took 22 ms a wave instead of 8. Blocks up to the heap's limit now come from the heap and
    freed memory stays mapped (the RSS stays near its peak instead of falling back between
    waves). The limit: the main thread's heap has none, other threads' heaps (the decoder
    worker's, the copy pool's) grow to 64 MiB, so a single block above that (a cache tensor of
    a very large batch) is still mapped afresh. Skipped when the operator set glibc's own
    MALLOC_* variables, or without glibc. Returns whether it was applied.
    """
    if any(name.startswith("MALLOC_") for name in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(libc.mallopt(m_mmap_threshold, 256 << 20)
                and libc.mallopt(m_trim_threshold, 1 << 30))


def event_loop_runner(kind: str) -> Callable[[Awaitable[int]], int]:
    """asyncio.run, or uvloop's: "auto" takes uvloop when it is installed.

    grpc.aio spends most of its Python time in the event loop; on uvloop the demo served
    5.7% more at 32 clients and a lone request 0.4 ms sooner (docs/benchmarks.md).
    """
    if kind == "asyncio":
        return asyncio.run  # type: ignore[return-value]
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed "
                             "(pip install uvloop; it is not available on Windows)") from None
        return asyncio.run  # type: ignore[return-value]
    return uvloop.run  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tfserve serve ...`; returns the exit code."""
    config = parse_config(argv)
    setup_logging(config.log_format, config.log_level)
    if config.workers > 1:
        from tfserve.workers import run_workers

        return run_workers(config)
    return run_server(config)


def run_server(config: ServerConfig, worker: int | None = None,
               on_serving: Callable[[], None] | None = None) -> int:
    """Load the model and serve in this process until stopped; returns the exit code."""
    keep_freed_memory()
    try:
        run = event_loop_runner(config.event_loop)
        runtime = load_runtime(config)
        return run(serve(config, runtime, worker, on_serving))
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
