"""The Open Inference Protocol over gRPC: `inference.GRPCInferenceService`
(proto/inference/grpc_service.proto), on the native gRPC front end's server and port, behind
the same interceptors (the bearer token) and through the same calls (GrpcCall: request ids,
deadlines, metrics, the access log, tracing).

    ServerLive, ServerReady        the server's liveness and readiness (false while starting
                                   or draining)
    ModelReady                     a model (at a version) takes requests
    ServerMetadata, ModelMetadata  the server's name and version; a model's versions and
                                   tensors
    ModelInfer                     one inference request (tensors: tfserve.frontends.
                                   oip_tensors), its outputs as raw_output_contents
    ModelStreamInfer               requests on one stream, each answered as it is decided: a
                                   translation streams its text (one response per text delta),
                                   an encoding answers once; a failed request is a response
                                   with its error_message, and the stream goes on

A request's errors are gRPC statuses as the native API's (INVALID_ARGUMENT naming the
protocol's field, NOT_FOUND for a model or version not served), except on ModelStreamInfer,
where they are the failed request's `error_message`; either way the message is bounded
(oip_tensors.protocol_error: gRPC's trailers take 8 KiB, and a longer status reached the
client as RESOURCE_EXHAUSTED). Triton's other rpcs answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

import grpc

from tfserve.frontends.grpc_api import GrpcCall, Malformed, Received, lenient_parser, unary
from tfserve.frontends.oip_tensors import (
    BYTES,
    FINAL_RESPONSE,
    PLATFORM,
    SERVICE_NAME,
    InferRequest,
    Tensor,
    TensorSpec,
    answered_model,
    bounded,
    bytes_elements,
    check_streamable,
    chunk_outputs,
    core_request,
    embedding_outputs,
    infer_outputs,
    model_inputs,
    model_outputs,
    protocol_error,
    raw_contents,
    request_reading,
)
from tfserve.proto import load_inference
from tfserve.serving import InvalidArgument, ServingCore, Status
from tfserve.serving.calls import CALL_ENDED
from tfserve.serving.requests import EncodeInput
from tfserve.serving.status import ModelNotFound
from tfserve.version import __version__

pb2, pb2_grpc = load_inference()
SERVICE = pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
assert SERVICE.full_name == SERVICE_NAME, SERVICE.full_name
_DONE = object()  # a stream's reader or one of its requests has ended


# -- requests -------------------------------------------------------------------------------


class BadRequest:
    """Stands for a ModelInferRequest whose tensors cannot be read (Received.malformed): the
    call's refusal, naming the field."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = str(error)

    def invalid(self) -> InvalidArgument:
        return InvalidArgument(self.error)


def infer_parser(data: bytes) -> Received:
    """ModelInferRequest bytes -> an InferRequest (its refusal when it does not parse or its
    tensors cannot be read: whatever reading them raises, request_reading)."""
    try:
        message = pb2.ModelInferRequest.FromString(data)
    except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
        return Received(InferRequest(""), len(data),
                        Malformed(pb2.ModelInferRequest.DESCRIPTOR.full_name, exc))
    try:
        with request_reading():
            return Received(infer_request(message), len(data))
    except InvalidArgument as exc:
        return Received(InferRequest(message.model_name, message.model_version, message.id),
                        len(data), BadRequest(exc))  # type: ignore[arg-type]


def infer_request(message: Any) -> InferRequest:
    """A ModelInferRequest as an InferRequest; InvalidArgument naming what cannot be read."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InvalidArgument(f"raw_input_contents holds {len(raw)} entries for "
                              f"{len(message.inputs)} inputs: one per input, in order")
    inputs = []
    for index, tensor in enumerate(message.inputs):
        if raw and tensor.HasField("contents"):
            raise InvalidArgument(f"inputs[{index}].contents: give the inputs' elements in "
                                  "contents or in raw_input_contents, not both")
        data: list[Any] = []
        if tensor.datatype == BYTES:  # the one data type tfserve's inputs take
            data = (bytes_elements(raw[index], f"raw_input_contents[{index}]") if raw
                    else list(tensor.contents.bytes_contents))
        inputs.append(Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), data,
                             parameters(tensor.parameters)))
    return InferRequest(message.model_name, message.model_version, message.id, inputs,
                        [output.name for output in message.outputs],
                        parameters(message.parameters))


def parameters(given: Mapping[str, Any]) -> dict[str, Any]:
    """A map of InferParameter as plain values (a parameter with no value: None)."""
    values = {}
    for name, parameter in given.items():
        which = parameter.WhichOneof("parameter_choice")
        values[name] = getattr(parameter, which) if which else None
    return values


# -- responses ------------------------------------------------------------------------------


def infer_response(outputs: list[Tensor], model: str, version: str, request_id: str,
                   response_parameters: Mapping[str, Any] | None = None) -> Any:
    """A ModelInferResponse with the outputs' elements in raw_output_contents."""
    response = pb2.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(raw_contents(tensor))
    for name, value in (response_parameters or {}).items():
        parameter = response.parameters[name]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            parameter.int64_param = value
        elif isinstance(value, float):  # a detected language's confidence
            parameter.double_param = value
        else:
            parameter.string_param = str(value)
    return response


def tensor_metadata(specs: tuple[TensorSpec, ...]) -> list[Any]:
    return [pb2.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype,
                                                     shape=spec.shape) for spec in specs]


class OipCall(GrpcCall):
    """A GrpcCall of the protocol's service (its spans are named after it), its failures
    answered and logged as the protocol's (protocol_error: field names, bounded messages)."""

    service = SERVICE_NAME

    def failed(self, exc: BaseException) -> tuple[Status, str]:
        status, details = super().failed(protocol_error(exc))
        return status, bounded(details)


class StreamCall(OipCall):
    """A call of one request on a ModelStreamInfer stream: its id goes back in its responses
    (the stream's metadata belongs to the stream), its failure in a response's error_message
    (a status would end the stream)."""

    async def send_metadata(self) -> None:
        self.metadata_sent = True


# -- the service ----------------------------------------------------------------------------


class InferenceService:
    """inference.GRPCInferenceService over a ServingCore."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    def ready(self) -> bool:
        """Whether the server takes calls: gRPC serves once the server has started, and
        until its drain."""
        return not self.core.calls.draining

    # the server's own state: no model, no call
    async def ServerLive(self, request: Received, context: grpc.aio.ServicerContext) -> Any:
        return pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Received, context: grpc.aio.ServicerContext) -> Any:
        return pb2.ServerReadyResponse(ready=self.ready())

    async def ServerMetadata(self, request: Received, context: grpc.aio.ServicerContext) -> Any:
        return pb2.ServerMetadataResponse(name="tfserve", version=__version__)

    async def ModelReady(self, received: Received, context: grpc.aio.ServicerContext) -> Any:
        """Ready while the server is and the model answers or can be loaded (the native
        per-model health); NOT_FOUND for a model or version not served."""
        request = received.message
        try:
            if received.malformed is not None:
                raise received.malformed.invalid()
            slot = self.core.repository.slot(request.name, request.version)
        except (ModelNotFound, InvalidArgument) as exc:
            code = (grpc.StatusCode.NOT_FOUND if isinstance(exc, ModelNotFound)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, bounded(str(exc)))
        return pb2.ModelReadyResponse(ready=self.ready() and slot.health == "SERVING")

    @unary("ModelMetadata", OipCall)
    async def ModelMetadata(self, request: Any, call: GrpcCall) -> Any:
        info = await self.core.model_info(call, request.name, request.version)
        encoder_only = info.decoder_layers == 0
        return pb2.ModelMetadataResponse(
            name=info.model, versions=[info.version] if info.version else [],
            platform=PLATFORM, inputs=tensor_metadata(model_inputs(encoder_only)),
            outputs=tensor_metadata(model_outputs(encoder_only, info.d_model)))

    @unary("ModelInfer", OipCall)
    async def ModelInfer(self, request: InferRequest, call: GrpcCall) -> Any:
        return call.sized(await self.infer(request, call))  # failures: OipCall.failed

    async def infer(self, request: InferRequest, call: GrpcCall) -> Any:
        return self.response(await infer_outputs(self.core, call, request), request, call)

    @staticmethod
    def response(outputs: list[Tensor], request: InferRequest, call: GrpcCall,
                 response_parameters: Mapping[str, Any] | None = None) -> Any:
        return infer_response(outputs, *answered_model(call, request), request.id,
                              response_parameters)

    async def ModelStreamInfer(self, requests: AsyncIterator[Received],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Each request of the stream runs as a call of its own, beside the others; their
        responses go out as they come. The stream ends once the client has sent its last
        request and each request has had its last response."""
        responses: asyncio.Queue[Any] = asyncio.Queue()  # responses, and _DONE markers
        running: set[asyncio.Task[None]] = set()

        def ended(task: asyncio.Task[None]) -> None:
            running.discard(task)
            responses.put_nowait(_DONE)  # after the task's responses

        async def read() -> None:
            try:
                async for received in requests:
                    call = StreamCall(self.core, "ModelStreamInfer", received, context)
                    task = asyncio.ensure_future(self._stream_one(received.message, call,
                                                                  responses))
                    running.add(task)
                    task.add_done_callback(ended)
            finally:
                responses.put_nowait(_DONE)

        reading = asyncio.ensure_future(read())
        try:
            while not (reading.done() and not running and responses.empty()):
                response = await responses.get()
                if response is not _DONE:
                    yield response
        finally:
            for task in (reading, *running):
                task.cancel()
            await asyncio.gather(reading, *running, return_exceptions=True)

    async def _stream_one(self, request: InferRequest, call: StreamCall,
                          responses: asyncio.Queue[Any]) -> None:
        """One request of a stream: its responses, or one with its error."""
        try:
            given = core_request(self.core, call, request)
            if isinstance(given, EncodeInput):
                outputs = embedding_outputs(await self.core.encode(call, given))
                responses.put_nowait(self._streamed(outputs, request, call, {
                    FINAL_RESPONSE: True}))
            else:
                try:
                    check_streamable(given)
                except InvalidArgument as exc:
                    call.refuse(exc)
                left = len(given.texts)
                async with aclosing(self.core.translate_stream(call, given)) as chunks:
                    async for chunk in chunks:
                        outputs, chunk_parameters = chunk_outputs(chunk)
                        left -= chunk.done
                        responses.put_nowait(self._streamed(outputs, request, call, {
                            **chunk_parameters, FINAL_RESPONSE: left == 0}))
        except BaseException as exc:
            _, details = call.failed(exc)
            if isinstance(exc, CALL_ENDED):
                raise
            responses.put_nowait(pb2.ModelStreamInferResponse(
                error_message=details, infer_response=pb2.ModelInferResponse(
                    model_name=request.model, model_version=request.version,
                    id=request.id)))
            return
        call.finish(Status.OK)

    def _streamed(self, outputs: list[Tensor], request: InferRequest, call: StreamCall,
                  response_parameters: Mapping[str, Any]) -> Any:
        response = self.response(outputs, request, call, response_parameters)
        call.check_size(response.ByteSize())
        return pb2.ModelStreamInferResponse(infer_response=response)


def add_inference_service(core: ServingCore, server: grpc.aio.Server) -> None:
    """Register inference.GRPCInferenceService on `server` (the native gRPC front end's),
    with request parsers that never raise (a request that does not parse is the call's
    INVALID_ARGUMENT, as on the native service)."""
    service = InferenceService(core)
    handlers = {}
    for method in SERVICE.methods:
        request_class = getattr(pb2, method.input_type.name)
        response_class = getattr(pb2, method.output_type.name)
        parse = (infer_parser if request_class is pb2.ModelInferRequest
                 else lenient_parser(request_class))
        make = (grpc.stream_stream_rpc_method_handler if method.client_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=parse,
                                     response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
