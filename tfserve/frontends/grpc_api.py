"""The gRPC transport of `tfserve.v1.Translator`: protobuf in, the serving core, protobuf out.

`TranslatorService` converts each request message into the core's plain request, calls the
core's method for its RPC (`ServingCore.translate`, ...), and converts the result back (both
with `tfserve.frontends.messages`, which the HTTP front end uses too). `GrpcCall` adds to the
core's `Call` what only gRPC knows: the peer, the `x-request-id` metadata in and out, the
deadline, and answering a `Status` as a `grpc.StatusCode` (`GRPC_CODES`). A request message
that does not parse is the call's refusal (`Malformed`, from `lenient_parser`), so that it is
answered INVALID_ARGUMENT through the usual path (logged, counted) instead of grpc's UNKNOWN;
the parser hands each on as `Received`, with its size (`Call.received`). A failed call is
answered with the status set on the context, not by raising `context.abort`, except a
refusal with UNAVAILABLE, which clients may retry elsewhere (`GrpcCall.fail` says why).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NamedTuple

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from tfserve.frontends.messages import (
    detect_input,
    detect_response,
    encode_input,
    encode_response,
    list_models_response,
    stream_response,
    translate_input,
    translate_response,
)
from tfserve.proto import load as load_stubs
from tfserve.serving import REQUEST_ID_KEY, Call, InvalidArgument, ServingCore, Status
from tfserve.serving.calls import CALL_ENDED

pb2, pb2_grpc = load_stubs()
SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Translator"].full_name  # tfserve.v1.Translator

GRPC_CODES: dict[Status, grpc.StatusCode] = {
    status: getattr(grpc.StatusCode, status.name) for status in Status}


# -- request messages -----------------------------------------------------------------------


class Malformed:
    """Stands for a request message that did not parse, so that the call is answered
    INVALID_ARGUMENT through the usual path (logged, counted) instead of grpc's UNKNOWN."""

    def __init__(self, message_name: str, error: BaseException) -> None:
        self.message_name = message_name
        # the error's text, not the error: its traceback holds the parser's frame, and with
        # it the whole received message
        self.error = f"{type(error).__name__}: {str(error)[:200]}"

    def invalid(self) -> InvalidArgument:
        return InvalidArgument(f"the request is not a valid {self.message_name} message "
                               f"({self.error})")


class Received(NamedTuple):
    """A request as the handlers get it: the message (an empty one when it did not parse),
    its size in bytes as received (a large one hands memory back when its call ends:
    Call.received), and why it did not parse (the call's refusal)."""

    message: Message
    size: int
    malformed: Malformed | None = None


def lenient_parser(message_class: type[Message]) -> Callable[[bytes], Received]:
    """A request deserializer that gives Malformed instead of raising."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Received:
        try:
            return Received(message_class.FromString(data), len(data))
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            return Received(message_class(), len(data), Malformed(name, exc))

    return parse


# -- calls ----------------------------------------------------------------------------------


class GrpcCall(Call):
    """A Call over a grpc.aio context: request id from the message or the metadata, the
    deadline from the context, the id echoed back in metadata, failures as statuses."""

    service = SERVICE_NAME  # the rpcs' service (the Open Inference Protocol's: oip_grpc)

    def __init__(self, core: ServingCore, rpc: str, received: Received,
                 context: grpc.aio.ServicerContext, streaming: bool = False) -> None:
        metadata = dict(context.invocation_metadata() or ())
        given = (getattr(received.message, "request_id", "") or metadata.get(REQUEST_ID_KEY)
                 or "")
        malformed = received.malformed
        # the peer is read now: once the call has ended (a cancelled stream), grpc's context
        # must not be asked for anything (context.peer() then crashed the process)
        super().__init__(core.calls, rpc, given_id=str(given), peer=context.peer(),
                         time_remaining=context.time_remaining(),
                         invalid=malformed.invalid() if malformed is not None else None,
                         trace_carrier=metadata, service=self.service)
        self.context = context
        self.streaming = streaming
        self.metadata_sent = False
        self.received(received.size)
        if self.large:
            # released once grpc's own coroutine, which holds the received bytes and the
            # message until the status is sent, has ended: only then can the memory go.
            # The callback holds `freed`, not this call: the context holds the callback
            freed = self.calls.freed_memory
            context.add_done_callback(lambda _context: freed.ended())

    # a large request is released by the context's done callback (above), not at finish()
    release_at_finish = False

    def sized(self, message: Message) -> Message:
        """The message, or ResponseTooLarge when grpc would refuse to send it."""
        self.check_size(message.ByteSize())
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

    async def accepted(self) -> None:
        await self.send_metadata()

    async def fail(self, exc: BaseException) -> None:
        """Record the failure and set its status on the context (or re-raise a
        cancellation); the handler then ends without a response, and grpc sends the status.

        Not `context.abort`: grpc keeps the AbortError it raises on the call's state, which
        the handler's frames in its traceback reach again (through the context): a reference
        cycle that holds the request message (up to --max-message-bytes, and the texts
        decoded from it) until the cyclic garbage collector runs. That collector counts
        objects, not bytes, and a refused request allocates few of them, so a client sending
        refused 15 MB requests kept dozens of them alive at once (docs/server.md, Memory).

        Except UNAVAILABLE before any response metadata went out (a draining or starting
        server refusing a call): that one is answered with `context.abort`, whose answer is
        trailers-only (one HEADERS frame carrying the status, the request id in it). A gRPC
        client retries a call only while the server has sent it nothing but that: grpc's
        own ending of a unary handler sends an empty response message with the status, and
        send_metadata() sends a stream's headers, either of which commits the call to this
        replica. Such refusals come only from a server that is on its way out or not yet
        serving, so the cycle above costs little.
        """
        status, details = self.failed(exc)
        if isinstance(exc, CALL_ENDED):
            raise exc
        if status is Status.UNAVAILABLE and not self.metadata_sent:
            self.metadata_sent = True
            await self.context.abort(GRPC_CODES[status], details,
                                     ((REQUEST_ID_KEY, self.request_id),))
        await self.send_metadata()
        self.context.set_code(GRPC_CODES[status])
        self.context.set_details(details)


Handler = Callable[..., Awaitable[Any]]


def unary(rpc: str, call_class: type[GrpcCall] = GrpcCall) -> Callable[[Handler], Handler]:
    """Wrap a unary servicer method `(self, request, call) -> response` in a GrpcCall (of
    `call_class`)."""

    def wrap(method: Handler) -> Handler:
        async def handler(self: TranslatorService, received: Received,
                          context: grpc.aio.ServicerContext) -> Any:
            call = call_class(self.core, rpc, received, context)
            try:
                # the core begins the call: a message that did not parse fails it then
                response = await method(self, received.message, call)
                await call.send_metadata()
            except BaseException as exc:
                await call.fail(exc)
                return None  # the status set by fail() is sent, without a message
            call.finish(Status.OK)
            return response

        handler.__name__ = method.__name__
        return handler

    return wrap


def streaming(rpc: str) -> Callable[[Callable[..., AsyncIterator[Any]]],
                                    Callable[..., AsyncIterator[Any]]]:
    """Wrap a server-streaming servicer method (an async generator) the same way."""

    def wrap(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def handler(self: TranslatorService, received: Received,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = GrpcCall(self.core, rpc, received, context, streaming=True)
            try:
                async for chunk in method(self, received.message, call):
                    await call.send_metadata()
                    yield chunk
                await call.send_metadata()
            except BaseException as exc:
                await call.fail(exc)
                return  # the stream ends with the status set by fail()
            call.finish(Status.OK)

        handler.__name__ = method.__name__
        return handler

    return wrap


# -- the service ----------------------------------------------------------------------------


class TranslatorService(pb2_grpc.TranslatorServicer):
    """tfserve.v1.Translator over a ServingCore; see proto/tfserve/v1/translator.proto."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    @unary("Translate")
    async def Translate(self, request: Message, call: GrpcCall) -> Message:
        translations = await self.core.translate_documents(call, translate_input(request))
        return call.sized(translate_response(translations, call.request_id))

    @streaming("TranslateStream")
    async def TranslateStream(self, request: Message, call: GrpcCall
                              ) -> AsyncIterator[Message]:
        async with aclosing(self.core.translate_stream(call, translate_input(request))
                            ) as chunks:
            async for chunk in chunks:
                yield call.sized(stream_response(chunk, call.request_id))

    @unary("Encode")
    async def Encode(self, request: Message, call: GrpcCall) -> Message:
        encodings = await self.core.encode(call, encode_input(request))
        return call.sized(encode_response(encodings, call.request_id))

    @unary("Detect")
    async def Detect(self, request: Message, call: GrpcCall) -> Message:
        guesses = await self.core.detect(call, detect_input(request))
        return call.sized(detect_response(guesses, call.request_id))

    @unary("GetModelInfo")
    async def GetModelInfo(self, request: Message, call: GrpcCall) -> Message:
        return await self.core.model_info(call, request.model)

    @unary("ListModels")
    async def ListModels(self, request: Message, call: GrpcCall) -> Message:
        return call.sized(list_models_response(*await self.core.list_models(call)))


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
