"""The Open Inference Protocol's hard edges (issue 39 item 6): every malformed header,
parameter, tensor or shape, on REST and on gRPC, is a 4xx / INVALID_ARGUMENT with a short
message (a client's string cut to 40 characters: tfserve.serving.requests.shown; a whole
message to MAX_ERROR_CHARS), the access log holds no more of it, nothing is logged as the
server's error, and the server keeps serving.

Requests are hand-written here (raw HTTP, raw protobuf): the real clients never send these.
A table of the cases the issue names, then property sweeps (hypothesis, derandomized) over
the JSON body, the header and the gRPC request.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oip_helpers import served  # noqa: F401 (the `server` fixture)
from server_helpers import ServerThread, demo_trained, tfserve_records

from tfserve.frontends.oip_rest import HEADER_LENGTH, parse_infer_request
from tfserve.frontends.oip_tensors import (
    MAX_ERROR_CHARS,
    encode_input,
    request_reading,
    translate_input,
)
from tfserve.proto import load_inference
from tfserve.serving.status import InvalidArgument

pytestmark = pytest.mark.skipif(not demo_trained(), reason="the demo checkpoint is not trained")
pb2, _ = load_inference()
INFER = "/v2/models/demo/infer"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
SHORT = 400  # characters: what a message about one bad field comes to, at most
GOOD = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["seven"]}]}
_TEXT = GOOD["inputs"][0]


def body(**fields: Any) -> dict[str, Any]:
    """A request body: GOOD with `fields` set."""
    return {**GOOD, **fields}


def text_with(**fields: Any) -> dict[str, Any]:
    """A request body whose text input has `fields` set."""
    return {"inputs": [{**_TEXT, **fields}]}


# -- the transports, raw --------------------------------------------------------------------


def post(server: ServerThread, path: str, data: bytes,
         headers: list[tuple[str, bytes]] = ()) -> tuple[int, dict[str, str], bytes]:
    """A raw POST (header values as bytes, sent as they are): status, headers, body."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        connection.putrequest("POST", path)
        given = {name.lower() for name, _ in headers}
        if "content-type" not in given:
            connection.putheader("Content-Type", "application/json")
        for name, value in headers:
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(data)))
        connection.endheaders(data)
        answer = connection.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()
    finally:
        connection.close()


def post_json(server: ServerThread, document: Any, path: str = INFER,
              headers: list[tuple[str, bytes]] = ()) -> tuple[int, bytes]:
    status, _, answer = post(server, path, json.dumps(document).encode(), headers)
    return status, answer


def protocol_error(status: int, answer: bytes) -> str:
    """The message of a protocol error answer ({"error": "<message>"}), checked: a 4xx,
    JSON, a string under the bound."""
    assert 400 <= status < 500, (status, answer[:300])
    document = json.loads(answer)
    assert set(document) == {"error"} and isinstance(document["error"], str), answer[:300]
    message = document["error"]
    assert len(message) <= MAX_ERROR_CHARS, message[:300]
    return message


def grpc_infer(server: ServerThread, message: Any) -> tuple[grpc.StatusCode, str]:
    """A ModelInfer call with a raw request (bytes or a ModelInferRequest): code, details."""
    data = message if isinstance(message, bytes) else message.SerializeToString()
    with grpc.insecure_channel(server.target, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as channel:
        infer = channel.unary_unary(MODEL_INFER, request_serializer=None,
                                    response_deserializer=None)
        try:
            infer(data, timeout=120)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def infer_request(shape: list[int] | None = None, texts: list[bytes] | None = None,
                  name: str = "text", datatype: str = "BYTES",
                  parameters: dict[str, Any] | None = None) -> Any:
    """A ModelInferRequest to the demo of one BYTES input (`texts`, its `shape`)."""
    request = pb2.ModelInferRequest(model_name="demo")
    texts = [b"seven"] if texts is None else texts
    tensor = request.inputs.add(name=name, datatype=datatype,
                                shape=[len(texts)] if shape is None else shape)
    tensor.contents.bytes_contents.extend(texts)
    for key, value in (parameters or {}).items():
        field = {bool: "bool_param", int: "int64_param", str: "string_param",
                 float: "double_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    return request


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[pytest.LogCaptureFixture]:
    """The server's records while the test runs; after it, none is an error of the server's
    (a traceback, a record at ERROR), and each access record's error is short."""
    records = tfserve_records(caplog, monkeypatch, logging.INFO)
    yield records
    loud = [f"{r.name}: {r.getMessage()[:200]}" for r in records.records
            if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, loud
    for record in records.records:
        error = getattr(record, "fields", {}).get("error", "")
        assert len(error) <= MAX_ERROR_CHARS, error[:300]


def still_serving(server: ServerThread) -> None:
    status, answer = post_json(server, GOOD)
    assert status == 200, answer[:300]
    assert json.loads(answer)["outputs"][0]["data"] == ["sept"]
    assert grpc_infer(server, infer_request())[0] == grpc.StatusCode.OK


# -- REST: the cases ----------------------------------------------------------------

LONG_NAME = "x" * 60


@pytest.mark.parametrize(("headers", "document", "starts"), [
    # the binary extension's header: non-ASCII digits, past int()'s digit limit, signs
    ([(HEADER_LENGTH, "²".encode())], GOOD, f"the {HEADER_LENGTH} header must be"),
    ([(HEADER_LENGTH, "٣".encode())], GOOD, f"the {HEADER_LENGTH} header must be"),
    ([(HEADER_LENGTH, b"1" * 5000)], GOOD, f"the {HEADER_LENGTH} header must be"),
    ([(HEADER_LENGTH, b"-1")], GOOD, f"the {HEADER_LENGTH} header must be"),
    ([(HEADER_LENGTH, b"1"), (HEADER_LENGTH, b"1")], GOOD, f"the {HEADER_LENGTH} header"),
    # the native API's call headers, on the protocol's route
    ([("x-request-timeout-ms", "²".encode())], GOOD, "x-request-timeout-ms must be one "),
    ([("x-request-id", b"i" * 5000)], GOOD, "request_id is 5000 characters"),
    # a lone surrogate in a string parameter, as in an input tensor
    ([], body(parameters={"target_prefix": "\ud800"}), "parameters.target_prefix is not"),
    ([], body(parameters={"source_language": "a\udfffb"}), "parameters.source_language is"),
    ([], {"inputs": [_TEXT, {**_TEXT, "name": "target_prefix", "data": ["\ud800"]}]},
     "target_prefix[0] is not UTF-8 text"),
    # client values echoed in full
    ([], body(parameters={"num_beams": list(range(300_000))}),
     "parameters.num_beams must be an integer, got a list of 300000 items"),
    ([], body(parameters={"num_beams": 10 ** 4000}),
     "parameters.num_beams must fit in 64 bits, got an integer of 4001 digits"),
    ([], body(parameters={"timeout": "9" * 100_000}), "parameters.timeout must be an integer"),
    ([], body(parameters={"timeout": 10 ** 4000}),
     "parameters.timeout must fit in 64 bits, got an integer of 4001 digits"),
    ([], body(parameters={"binary_data_output": {"a": "b" * 100_000}}),
     "parameters.binary_data_output must be a boolean, got an object"),
    ([], text_with(shape=[1] * 20_000),
     "text: the shape must be [N] or [N, 1], got [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ... "
     "(20000 dimensions)"),
    ([], text_with(shape=[2] + [1] * 20_000), "text: the shape must be"),
    ([], text_with(datatype="B" * 100_000), "inputs[0].datatype of 'text' must be BYTES"),
    ([], text_with(name="n" * 100_000), "inputs[0].name is 'nnnn"),
    ([], {"inputs": [{**_TEXT, "name": "target_prefix"}] * 2 + [_TEXT]},
     "inputs[1].name: the input 'target_prefix' is given twice"),
    ([], body(outputs=[{"name": "s" * 100_000}]), "outputs[0].name is 'ssss"),
    ([], body(model_name="m" * 100_000), "model_name 'mmmm"),
    ([], text_with(parameters={"binary_data_size": list(range(100_000))}),
     "inputs[0].parameters.binary_data_size must be"),
    ([], body(id="i" * 100_000), "request_id is 100000 characters"),
    ([], text_with(data=[list(range(100_000))]), "text: the shape [1] holds 1 elements, the "),
    # an unknown parameter's name, however long, quoted once and whole
    ([], body(parameters={LONG_NAME: 1}),
     f"parameters[{LONG_NAME[:40]!r}... (60 characters)] is not a parameter of this model;"),
    ([], body(parameters={"a'b": 1}), "parameters[\"a'b\"] is not a parameter of this model"),
    # Content-Type: JSON or the binary extension's octet-stream (or none); nothing else
    ([("Content-Type", b"text/plain")], GOOD, "the request body must be the protocol's JSON"),
    ([("Content-Type", b"application/x-www-form-urlencoded")], GOOD,
     "the request body must be the protocol's JSON"),
    ([("Content-Type", b"multipart/form-data; boundary=x")], GOOD, "the request body must"),
])
def test_each_malformed_request_is_a_short_400(server: ServerThread, quiet: Any,
                                               headers: list[tuple[str, bytes]],
                                               document: Any, starts: str) -> None:
    message = protocol_error(*post_json(server, document, headers=headers))
    assert message.startswith(starts), message[:300]
    assert len(message) <= SHORT, message[:300]


def test_a_timeout_header_past_the_digit_limit(server: ServerThread) -> None:
    status, answer = post_json(server, GOOD, headers=[("x-request-timeout-ms", b"9" * 5000)])
    assert status == 400, answer[:300]


@pytest.mark.parametrize("data", [
    b'{"inputs": [], "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], '
    b'"data": ["seven"]}]}',
    b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["seven"]}], '
    b'"parameters": {"num_beams": 2, "num_beams": 1}}',
])
def test_a_key_given_twice_is_refused(server: ServerThread, quiet: Any, data: bytes) -> None:
    """As the native API does: JSON parsers differ in which of the two they keep."""
    status, _, answer = post(server, INFER, data)
    assert protocol_error(status, answer).startswith("the request body gives the key ")


@pytest.mark.parametrize("content_type", [
    None, b"application/json", b"application/json; charset=utf-8", b"application/octet-stream",
    b"Application/JSON"])
def test_the_content_types_the_clients_send_are_taken(server: ServerThread,
                                                      content_type: bytes | None) -> None:
    """tritonclient.http sends none, its aio client and KServe's binary requests
    application/octet-stream, KServe's JSON ones application/json."""
    headers = [] if content_type is None else [("Content-Type", content_type)]
    data = json.dumps(GOOD).encode()
    if content_type is None:  # http.client's putheader: skip post()'s default
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
        connection.request("POST", INFER, data, {"Content-Length": str(len(data))})
        answer = connection.getresponse()
        status, answered = answer.status, answer.read()
        connection.close()
    else:
        status, _, answered = post(server, INFER, data, headers)
    assert status == 200, answered[:300]


def test_long_paths_are_cut_too(server: ServerThread, quiet: Any) -> None:
    status, answer = post_json(server, GOOD, path=f"/v2/models/{'m' * 6000}/infer")
    assert status == 404 and len(protocol_error(status, answer)) <= SHORT
    version = "v" * 6000
    status, answer = post_json(server, GOOD, path=f"/v2/models/demo/versions/{version}/infer")
    assert status == 404 and len(protocol_error(status, answer)) <= SHORT
    still_serving(server)


# -- gRPC: the cases ----------------------------------------------------------------


@pytest.mark.parametrize(("request_", "starts"), [
    (infer_request(shape=[1] * 20_000),
     "text: the shape must be [N] or [N, 1], got [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ... "
     "(20000 dimensions)"),
    (infer_request(shape=[2] + [1] * 20_000), "text: the shape must be"),
    (infer_request(parameters={LONG_NAME: 1}),
     f"parameters[{LONG_NAME[:40]!r}... (60 characters)] is not a parameter of this model"),
    (infer_request(parameters={"num_beams": "4" * 1_000_000}),
     "parameters.num_beams must be an integer, got '4444"),
    (infer_request(parameters={"target_prefix": "p" * 1_000_000}), "target_prefix"),
    (infer_request(name="n" * 1_000_000), "inputs[0].name is 'nnnn"),
    (infer_request(datatype="D" * 1_000_000), "inputs[0].datatype of 'text' must be BYTES"),
    (b"\xff" * 100, "the request is not a valid inference.ModelInferRequest message"),
])
def test_grpc_malformed_requests_are_short_invalid_arguments(
        server: ServerThread, quiet: Any, request_: Any, starts: str) -> None:
    code, details = grpc_infer(server, request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:300])
    assert details.startswith(starts) and len(details) <= SHORT, details[:300]


def test_grpc_raw_contents_are_checked(server: ServerThread, quiet: Any) -> None:
    request = pb2.ModelInferRequest(model_name="demo")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(b"\x05\x00\x00\x00ab")
    code, details = grpc_infer(server, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("raw_input_contents[0]: a raw BYTES element of 5 bytes")
    request.raw_input_contents.append(b"")
    code, details = grpc_infer(server, request)
    assert details.startswith("raw_input_contents holds 2 entries for 1 inputs")
    still_serving(server)


def test_grpc_names_of_models_are_cut(server: ServerThread, quiet: Any) -> None:
    request = infer_request()
    request.model_name = "m" * 1_000_000
    code, details = grpc_infer(server, request)
    assert code == grpc.StatusCode.NOT_FOUND and len(details) <= SHORT, details[:300]
    with grpc.insecure_channel(server.target) as channel:
        ready = channel.unary_unary("/inference.GRPCInferenceService/ModelReady",
                                    request_serializer=pb2.ModelReadyRequest.SerializeToString,
                                    response_deserializer=pb2.ModelReadyResponse.FromString)
        with pytest.raises(grpc.RpcError) as failed:
            ready(pb2.ModelReadyRequest(name="m" * 1_000_000), timeout=120)
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(failed.value.details()) <= SHORT


def test_grpc_stream_errors_are_cut_and_the_stream_goes_on(server: ServerThread,
                                                           quiet: Any) -> None:
    """ModelStreamInfer: a malformed request's error_message is as short as ModelInfer's
    status, and the stream's next request is answered."""
    with grpc.insecure_channel(server.target) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb2.ModelInferRequest.SerializeToString,
            response_deserializer=pb2.ModelStreamInferResponse.FromString)
        bad, good = infer_request(shape=[1] * 20_000), infer_request()
        bad.id, good.id = "bad", "good"
        (failed,) = stream(iter([bad]), timeout=120)
        assert failed.infer_response.id == "bad"
        assert failed.error_message.startswith("text: the shape must be [N] or [N, 1], got ")
        assert len(failed.error_message) <= SHORT
        texts = [response for response in stream(iter([bad, good]), timeout=120)
                 if not response.error_message]
        assert texts and {response.infer_response.id for response in texts} == {"good"}


# -- property sweeps ------------------------------------------------------------------------

_KEYS = ("inputs", "outputs", "parameters", "name", "datatype", "shape", "data", "id",
         "model_name", "model_version", "binary_data_size", "binary_data", "text",
         "target_prefix", "num_beams", "timeout", "binary_data_output", "max_new_tokens",
         "source_language", "translation", "BYTES", "x" * 50)
_SCALARS = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
            | st.floats(allow_nan=True) | st.text(max_size=60) | st.sampled_from(_KEYS)
            | st.sampled_from(("\ud800", "a\udfffb", "", "x" * 5000)))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(_KEYS) | st.text(max_size=50), inner, max_size=4), max_leaves=25)


def _tensor() -> st.SearchStrategy[dict[str, Any]]:
    """An input tensor, nearly right: each field maybe wrong."""
    return st.fixed_dictionaries({
        "name": st.sampled_from(("text", "target_prefix")) | _JSON,
        "datatype": st.just("BYTES") | _JSON,
        "shape": st.lists(st.integers(-3, 2 ** 64), max_size=3) | _JSON,
    }, optional={"data": st.lists(st.text(max_size=10) | _JSON, max_size=3) | _JSON,
                 "parameters": st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=2)})


_DOCUMENTS = _JSON | st.fixed_dictionaries({"inputs": st.lists(_tensor(), max_size=3)},
                                           optional={
    "parameters": st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=50), _JSON,
                                  max_size=3),
    "outputs": st.lists(st.fixed_dictionaries({"name": _JSON}), max_size=2) | _JSON,
    "id": _JSON, "model_name": _JSON})
_SWEEP = settings(max_examples=120, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))


@_SWEEP
@given(document=_DOCUMENTS)
def test_sweep_parsing_raises_only_invalid_argument(document: Any) -> None:
    """The pure part of the protocol's REST side: a document is an InferRequest, or
    InvalidArgument (never another exception: request_reading would make it one, but each
    is a check missing) with a short message."""
    try:
        request = parse_infer_request(document, memoryview(b""), "demo", "")
        for convert in (translate_input, encode_input):
            try:
                convert(request)
            except InvalidArgument as exc:
                assert len(str(exc)) <= MAX_ERROR_CHARS, str(exc)[:300]
    except InvalidArgument as exc:
        assert len(str(exc)) <= MAX_ERROR_CHARS, str(exc)[:300]


def test_request_reading_makes_any_error_invalid_argument() -> None:
    """The net under the checks: whatever reading a request raises is the request's fault."""
    for raised in (ValueError("x" * 100_000), TypeError(), KeyError("k"), RecursionError(),
                   UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")):
        with pytest.raises(InvalidArgument) as caught, request_reading():
            raise raised
        assert str(caught.value).startswith("the request cannot be read")
        assert len(str(caught.value)) <= SHORT
    with pytest.raises(InvalidArgument, match="^kept$"), request_reading():
        raise InvalidArgument("kept")


@_SWEEP
@given(document=_DOCUMENTS,
       header=st.none()
       | st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=30)
       | st.from_regex(r"[0-9]{1,6000}", fullmatch=True))
def test_sweep_rest_answers_4xx_or_a_translation(server: ServerThread, quiet: Any,
                                                 document: Any, header: str | None) -> None:
    data = json.dumps(document).encode()
    headers = [] if header is None else [(HEADER_LENGTH, header.encode())]
    status, _, answer = post(server, INFER, data, headers)
    if status != 200:
        protocol_error(status, answer)


def _grpc_requests() -> st.SearchStrategy[Any]:
    def build(name: str, datatype: str, shape: list[int], texts: list[bytes],
              parameters: dict[str, Any]) -> Any:
        return infer_request(shape, texts, name, datatype, parameters)

    values = (st.booleans() | st.integers(-(2 ** 63), 2 ** 63 - 1) | st.text(max_size=60)
              | st.floats())
    return st.builds(build, st.sampled_from(("text", "target_prefix")) | st.text(max_size=60),
                     st.just("BYTES") | st.text(max_size=20),
                     st.lists(st.integers(-(2 ** 63), 2 ** 63 - 1), max_size=300),
                     st.lists(st.binary(max_size=8), max_size=3),
                     st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=60), values,
                                     max_size=3))


@_SWEEP
@given(request=_grpc_requests() | st.binary(max_size=200))
def test_sweep_grpc_answers_invalid_argument_or_a_translation(server: ServerThread,
                                                              quiet: Any, request: Any) -> None:
    code, details = grpc_infer(server, request)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    assert len(details) <= MAX_ERROR_CHARS, details[:300]


def test_after_the_sweeps_the_server_still_serves(server: ServerThread) -> None:
    still_serving(server)
