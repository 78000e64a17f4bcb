"""The Open Inference Protocol over HTTP (KServe's v2 REST API, with Triton's binary tensor
data extension), on the native HTTP front end's port and aiohttp application:

    GET  /v2                                            server metadata
    GET  /v2/health/live, /v2/health/ready              the native API's probes (http_api)
    GET  /v2/models/{name}[/versions/{version}]         model metadata: versions, tensors
    GET  /v2/models/{name}[/versions/{version}]/ready   the native per-model probe
    POST /v2/models/{name}[/versions/{version}]/infer   inference

A request body is the protocol's JSON, or (binary tensor data) a JSON header of
`Inference-Header-Content-Length` bytes followed by the inputs whose parameters give a
`binary_data_size`, in order; its Content-Type is application/json, application/octet-stream
or none (what tritonclient and KServe send), its JSON objects give each key once (as the
native API's). An answer is JSON, or binary in the same way when the request asks for it (the
`binary_data_output` parameter, or an output's `binary_data`). Tensors and parameters are
tfserve.frontends.oip_tensors'; each call goes through the core as the native API's calls do
(HttpCall: request ids, deadlines, metrics, the access log, tracing; the bearer token of the
app's middleware). A failure is `{"error": "<message>"}` with the native API's HTTP status
for it (400 for bad input, naming the field; 404 for a model or version not served), its
message bounded (oip_tensors.protocol_error). The per-model probe, versioned or not, is the
native API's route, and answers its failures (401 included) as the native API does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import web

from tfserve.frontends.front_end import Readiness
from tfserve.frontends.http_api import (
    HTTP_STATUS,
    OIP_ROUTE_PREFIX,
    BodyTooLarge,
    HttpCall,
    read_body,
    read_call,
)
from tfserve.frontends.http_errors import oip_error_response
from tfserve.frontends.messages import _unique_keys as unique_keys
from tfserve.frontends.oip_tensors import (
    BYTES,
    PLATFORM,
    SERVICE_NAME,
    InferRequest,
    Tensor,
    answered_model,
    bounded,
    bytes_elements,
    infer_outputs,
    model_inputs,
    model_outputs,
    protocol_error,
    raw_contents,
    request_reading,
    shown_value,
    wants_binary,
)
from tfserve.serving import ServingCore
from tfserve.serving.calls import CALL_ENDED
from tfserve.serving.requests import shown
from tfserve.serving.status import InvalidArgument, Status
from tfserve.version import __version__

HEADER_LENGTH = "Inference-Header-Content-Length"  # the JSON part of a binary body or answer
# a request body's Content-Types (or none): the protocol's JSON, and what Triton's binary
# tensor data is sent as (tritonclient.http sends none, its aio client application/octet-
# stream even for JSON). Not text/plain or a form's: those a browser sends to any origin
# without asking it first
CONTENT_TYPES = ("application/json", "application/octet-stream")
MAX_LENGTH_DIGITS = 20  # a longer Inference-Header-Content-Length is past any body's length
EXTENSIONS = ("binary_tensor_data",)
MODEL = "/v2/models/{name}"
VERSIONED = "/v2/models/{name}/versions/{version}"
NATIVE_MODEL_READY = MODEL + "/ready"  # served by tfserve.frontends.http_api


class OipHttpCall(HttpCall):
    """An HttpCall answering failures as the protocol does: `{"error": "<message>"}`, the
    message bounded in the answer and in the access log (protocol_error)."""

    service = SERVICE_NAME

    def failed(self, exc: BaseException) -> tuple[Status, str]:
        status, details = super().failed(protocol_error(exc))
        return status, bounded(details)

    def error(self, exc: BaseException) -> web.Response:
        status, details = self.failed(exc)
        if isinstance(exc, CALL_ENDED):
            raise exc
        http_status = 413 if isinstance(exc, BodyTooLarge) else HTTP_STATUS[status]
        return oip_error_response(details, http_status, self.headers)


# -- request bodies -------------------------------------------------------------------------


async def read_infer_request(request: web.Request) -> InferRequest:
    """The request's body as an InferRequest of the model its path names; InvalidArgument
    naming what is wrong with it (its Content-Type, its binary data's header, its JSON),
    or, for whatever else reading it raises, saying it cannot be read (request_reading)."""
    if request.content_type not in CONTENT_TYPES:  # aiohttp: no header is octet-stream
        raise InvalidArgument("the request body must be the protocol's JSON (Content-Type "
                              "application/json), or JSON and binary tensor data "
                              "(application/octet-stream), got "
                              f"{shown(request.headers.get('Content-Type', ''))}")
    body = await read_body(request)
    with request_reading():
        header, binary = _split_body(body, request.headers.getall(HEADER_LENGTH, []))
        try:
            document = json.loads(header, object_pairs_hook=unique_keys)
        except InvalidArgument:  # a key given twice
            raise
        except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8
            raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
        match = request.match_info
        return parse_infer_request(document, binary, match["name"], match.get("version", ""))


def _split_body(body: bytearray, header_lengths: list[str]) -> tuple[bytearray, memoryview]:
    """The body's JSON part and its binary data, as its Inference-Header-Content-Length
    header (given once, ASCII digits: str.isdigit takes others, which int() may refuse)
    splits it; all JSON without the header."""
    if not header_lengths:
        return body, memoryview(b"")
    text = header_lengths[0]
    if len(header_lengths) > 1 or not (text.isascii() and text.isdigit()) or (
            len(text) > MAX_LENGTH_DIGITS or int(text) > len(body)):
        given = "several headers" if len(header_lengths) > 1 else shown(text)
        raise InvalidArgument(f"the {HEADER_LENGTH} header must be the length of the body's "
                              f"JSON part, at most the body's {len(body)} bytes, got {given}")
    return body[:int(text)], memoryview(body)[int(text):]


def parse_infer_request(document: Any, binary: memoryview, model: str,
                        version: str) -> InferRequest:
    """The protocol's JSON inference request (`binary`: the binary data after it)."""
    if not isinstance(document, dict):
        raise InvalidArgument("the request body must be a JSON object (an inference request)")
    _no_unknown_keys(document, ("id", "model_name", "model_version", "parameters", "inputs",
                                "outputs"), "the request body")
    # KServe's client names the model in the body too: it must be the path's
    for key, value in (("model_name", model), ("model_version", version)):
        if key in document and document[key] != value:
            raise InvalidArgument(f"{key} {shown_value(document[key])} is not the one the "
                                  f"path names ({shown(value)})")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("id must be a string")
    parameters = _object(document.get("parameters", {}), "parameters")
    inputs_given = document.get("inputs")
    if not isinstance(inputs_given, list):
        raise InvalidArgument("inputs must be a list of input tensors")
    inputs, offset = [], 0
    for index, item in enumerate(inputs_given):
        tensor, size = _input_tensor(item, f"inputs[{index}]", binary[offset:])
        inputs.append(tensor)
        offset += size
    if offset != len(binary):
        raise InvalidArgument(f"the body holds {len(binary)} bytes of binary data after its "
                              f"JSON part, its inputs' binary_data_size add up to {offset}")
    outputs = _requested_outputs(document.get("outputs", []))
    return InferRequest(model, version, request_id, inputs, outputs, parameters)


def _input_tensor(item: Any, where: str, binary: memoryview) -> tuple[Tensor, int]:
    """One input tensor, and how many bytes of the binary data it takes."""
    item = _object(item, where)
    _no_unknown_keys(item, ("name", "shape", "datatype", "parameters", "data"), where)
    name, datatype = item.get("name"), item.get("datatype")
    for key, value in (("name", name), ("datatype", datatype)):
        if not isinstance(value, str):
            raise InvalidArgument(f"{where}.{key} must be a string")
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(
            isinstance(size, int) and not isinstance(size, bool) for size in shape):
        raise InvalidArgument(f"{where}.shape must be a list of integers")
    parameters = _object(item.get("parameters", {}), f"{where}.parameters")
    size = parameters.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= len(binary):
            raise InvalidArgument(f"{where}.parameters.binary_data_size must be the number of "
                                  f"bytes of its binary data, at most the {len(binary)} left, "
                                  f"got {shown_value(size)}")
        if "data" in item:
            raise InvalidArgument(f"{where}: give data or parameters.binary_data_size, not both")
        if datatype != BYTES:  # the one data type tfserve's inputs take
            data: list[Any] = []
        else:
            data = bytes_elements(binary[:size], where)
        return Tensor(name, datatype, tuple(shape), data, parameters), size
    if "data" not in item:
        raise InvalidArgument(f"{where}.data is missing (or parameters.binary_data_size)")
    data = [_element(value, f"{where}.data") for value in _flat(item["data"], f"{where}.data")]
    return Tensor(name, datatype, tuple(shape), data, parameters), 0


def _element(value: Any, where: str) -> Any:
    """A JSON element: a BYTES element (a string) as its UTF-8 bytes, others as they are."""
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value


def _flat(data: Any, where: str) -> list[Any]:
    """A tensor's JSON data, flat or nested lists in row-major order, flattened."""
    if not isinstance(data, list):
        raise InvalidArgument(f"{where} must be a list of the tensor's elements")
    flat: list[Any] = []
    pending = [iter(data)]
    while pending:
        for value in pending[-1]:
            if isinstance(value, list):
                pending.append(iter(value))
                break
            flat.append(value)
        else:
            pending.pop()
    return flat


def _requested_outputs(given: Any) -> list[tuple[str, bool | None]]:
    """The outputs asked for: (name, binary_data or None) each."""
    if not isinstance(given, list):
        raise InvalidArgument("outputs must be a list of requested outputs")
    outputs = []
    for index, item in enumerate(given):
        where = f"outputs[{index}]"
        item = _object(item, where)
        _no_unknown_keys(item, ("name", "parameters"), where)
        if not isinstance(item.get("name"), str):
            raise InvalidArgument(f"{where}.name must be a string")
        parameters = _object(item.get("parameters", {}), f"{where}.parameters")
        _no_unknown_keys(parameters, ("binary_data",), f"{where}.parameters")
        binary = parameters.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise InvalidArgument(f"{where}.parameters.binary_data must be a boolean")
        outputs.append((item["name"], binary))
    return outputs


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object")
    return value


def _no_unknown_keys(document: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in document:
        if key not in known:
            raise InvalidArgument(f"{where}: unknown field {shown(key)}; the fields are "
                                  f"{', '.join(known)}")


# -- answers --------------------------------------------------------------------------------


def infer_answer(request: InferRequest, binary_asked: Mapping[str, bool | None],
                 outputs: list[Tensor], model: str, version: str,
                 headers: Mapping[str, str]) -> web.Response:
    """The protocol's inference response: JSON, or a JSON header then the binary outputs'
    data when the request asks for them as binary data."""
    everything_binary = wants_binary(request)
    described, binary = [], []
    for tensor in outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": list(tensor.shape)}
        asked = binary_asked.get(tensor.name)
        if asked or (asked is None and everything_binary):
            raw = raw_contents(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            binary.append(raw)
        else:
            entry["data"] = (tensor.data.tolist() if isinstance(tensor.data, np.ndarray)
                             else list(tensor.data))
        described.append(entry)
    document = json.dumps({"model_name": model, "model_version": version, "id": request.id,
                           "parameters": {}, "outputs": described}, ensure_ascii=False,
                          separators=(",", ":")).encode("utf-8")
    if not binary:
        return web.Response(body=document, content_type="application/json", headers=headers)
    return web.Response(body=b"".join([document, *binary]),
                        content_type="application/octet-stream",
                        headers={**headers, HEADER_LENGTH: str(len(document))})


def model_metadata(info: Any) -> dict[str, Any]:
    """A model's metadata from its ModelInfo: its name, version, platform and tensors."""
    encoder_only = info.decoder_layers == 0
    return {"name": info.model, "versions": [info.version] if info.version else [],
            "platform": PLATFORM,
            "inputs": [_spec(spec) for spec in model_inputs(encoder_only)],
            "outputs": [_spec(spec) for spec in model_outputs(encoder_only, info.d_model)]}


def _spec(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


# -- the handlers ---------------------------------------------------------------------------


class OipRest:
    """The protocol's REST handlers over a ServingCore."""

    def __init__(self, core: ServingCore, ready: Readiness) -> None:
        self.core = core
        self.ready = ready

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "tfserve", "version": __version__,
                                  "extensions": list(EXTENSIONS)})

    async def model_metadata(self, request: web.Request) -> web.Response:
        match = request.match_info
        call = OipHttpCall(self.core, "ModelMetadata", request)
        try:
            info = await self.core.model_info(call, match["name"], match.get("version", ""))
            answer = web.json_response(model_metadata(info), headers=call.headers)
        except BaseException as exc:
            return call.error(exc)
        call.finish(Status.OK)
        return answer

    async def infer(self, request: web.Request) -> web.Response:
        match = request.match_info
        call, infer_request = await read_call(
            self.core, request, "ModelInfer", read_infer_request, OipHttpCall,
            lambda: InferRequest(match["name"], match.get("version", "")))
        try:
            answer = await self._infer(call, infer_request)
        except BaseException as exc:
            return call.error(exc)
        call.finish(Status.OK)
        return answer

    async def _infer(self, call: OipHttpCall, request: InferRequest) -> web.Response:
        names = InferRequest(request.model, request.version, request.id, request.inputs,
                             [name for name, _ in request.outputs], request.parameters)
        outputs = await infer_outputs(self.core, call, names)
        answer = infer_answer(names, dict(request.outputs), outputs,
                              *answered_model(call, request), call.headers)
        call.check_size(answer.content_length or 0)
        return answer


# the routes this module adds (method, path, handler: an OipRest method, or "model_ready" for
# the native per-model probe); the protocol documents them, not the native /openapi.json
ROUTES = (("GET", "/v2", "server_metadata"),
          ("GET", MODEL, "model_metadata"), ("GET", VERSIONED, "model_metadata"),
          ("POST", MODEL + "/infer", "infer"), ("POST", VERSIONED + "/infer", "infer"),
          ("GET", VERSIONED + "/ready", "model_ready"))


def add_routes(app: web.Application, core: ServingCore, ready: Readiness) -> None:
    """Add the protocol's routes to the native HTTP front end's application (whose probes
    /v2/health/* and /v2/models/{name}/ready they share)."""
    api = OipRest(core, ready)
    model_ready = next(route.handler for route in app.router.routes()
                       if route.resource is not None
                       and route.resource.canonical == NATIVE_MODEL_READY)
    for index, (method, path, handler) in enumerate(ROUTES):
        if handler == "model_ready":
            # the native probe under its versioned path, unnamed as its unversioned path is:
            # its 401 is the native API's, as its 404 and 503 are (the protocol gives a
            # readiness answer no body: clients read its status)
            app.router.add_route(method, path, model_ready)
            continue
        # the name marks a route of the protocol: the app's token check answers its 401 as
        # the protocol does (OIP_ROUTE_PREFIX, tfserve.frontends.http_api.bearer_token)
        app.router.add_route(method, path, getattr(api, handler),
                             name=f"{OIP_ROUTE_PREFIX}{handler}{index}")
