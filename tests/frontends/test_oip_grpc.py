"""The Open Inference Protocol over gRPC (tfserve.frontends.oip_grpc), driven by
tritonclient.grpc: sync and async infer, streaming (ModelStreamInfer), model metadata,
readiness, errors (INVALID_ARGUMENT naming the field), the bearer token, model versions.

The server serves a repository of two models: the trained demo (English -> French) and a
small encoder model.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from oip_helpers import (
    FRENCH,
    TEXTS,
    TOKEN,
    grpc_url,
    oip_repository,
    oip_server,
    one_span,
    served,  # noqa: F401 (the `server` fixture)
    spans_of,
)
from server_helpers import ServerThread, demo_trained

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.skipif(not demo_trained(), reason="the demo checkpoint is not trained")
WAIT = 120.0  # seconds: a safety net for the waits on the clients' callbacks
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def client(server: ServerThread) -> Iterator[Any]:
    made = grpcclient.InferenceServerClient(grpc_url(server))
    yield made
    made.close()


def text_input(texts: list[str], name: str = "text") -> Any:
    tensor = grpcclient.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def decoded(array: np.ndarray) -> list[str]:
    return [value.decode() for value in array.ravel()]


def test_readiness_and_metadata(client: Any) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("demo") and client.is_model_ready("encoder")
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "tfserve"
    demo = client.get_model_metadata("demo", as_json=True)
    assert demo["platform"] == "tfserve" and len(demo["versions"]) == 1
    assert [(t["name"], t["datatype"], t["shape"]) for t in demo["inputs"]] == [
        ("text", "BYTES", ["-1"]), ("target_prefix", "BYTES", ["-1"])]
    assert [(t["name"], t["datatype"]) for t in demo["outputs"]] == [
        ("translation", "BYTES"), ("score", "FP32")]
    version = demo["versions"][0]
    assert client.is_model_ready("demo", version)
    encoder = client.get_model_metadata("encoder", as_json=True)
    assert encoder["outputs"][0]["shape"] == ["-1", "32"]
    for name, version_given in (("missing", ""), ("demo", "0000")):
        with pytest.raises(InferenceServerException) as raised:
            client.get_model_metadata(name, version_given)
        assert raised.value.status() == "StatusCode.NOT_FOUND", raised.value
    with pytest.raises(InferenceServerException) as raised:
        client.is_model_ready("missing")
    assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_infer(client: Any, server: ServerThread) -> None:
    before = server.metrics.value("tfserve_requests_total",
                                  {"model": "demo", "rpc": "ModelInfer", "code": "OK"})
    version = client.get_model_metadata("demo").versions[0]
    result = client.infer("demo", [text_input(TEXTS)], model_version=version,
                          request_id="grpc-1", parameters={"num_beams": 2,
                                                           "length_penalty": 1.0})
    assert decoded(result.as_numpy("translation")) == FRENCH
    assert result.as_numpy("score").dtype == np.float32
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == (
        "grpc-1", "demo", version)
    assert server.metrics.value("tfserve_requests_total", {
        "model": "demo", "rpc": "ModelInfer", "code": "OK"}) == before + 1
    # one output asked for, and the encoder's embeddings
    only = client.infer("demo", [text_input(["seven"])],
                        outputs=[grpcclient.InferRequestedOutput("score")])
    assert only.as_numpy("translation") is None and only.as_numpy("score").shape == (1,)
    embedding = client.infer("encoder", [text_input(TEXTS)]).as_numpy("embedding")
    assert embedding.shape == (2, 32) and embedding.dtype == np.float32


def test_async_infer(client: Any) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    for text in TEXTS:
        client.async_infer("demo", [text_input([text])],
                           callback=lambda result, error: answers.put((result, error)),
                           request_id=text)
    found = {}
    for _ in TEXTS:
        result, error = answers.get(timeout=WAIT)
        assert error is None, error
        found[result.get_response().id] = decoded(result.as_numpy("translation"))[0]
    assert found == dict(zip(TEXTS, FRENCH))


def test_stream_infer_streams_each_text(client: Any) -> None:
    """ModelStreamInfer: each text's translation arrives as text deltas; its last response
    has its score; the request's last response says triton_final_response."""
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("demo", [text_input(TEXTS)], request_id="stream-1")
        client.async_stream_infer("demo", [text_input(["seven"])], request_id="stream-2",
                                  parameters={"num_beams": 40})
        texts: dict[int, str] = {}
        scores: dict[int, float] = {}
        final = error_text = None
        while final is None or error_text is None:
            result, error = responses.get(timeout=WAIT)
            if error is not None:
                error_text = error.message()
                continue
            response = result.get_response()
            assert response.id == "stream-1"
            parameters = response.parameters
            index = parameters["index"].int64_param
            texts[index] = texts.get(index, "") + decoded(result.as_numpy("translation"))[0]
            if parameters["done"].bool_param:
                scores[index] = float(result.as_numpy("score")[0])
            if parameters["triton_final_response"].bool_param:
                final = response
        assert [texts[0], texts[1]] == FRENCH and set(scores) == {0, 1}
        assert error_text.startswith("parameters.num_beams must be in [1, 16], got 40")
    finally:
        client.stop_stream()


def test_stream_refuses_several_hypotheses(client: Any) -> None:
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("demo", [text_input(["seven"])],
                                  parameters={"num_return_sequences": 2, "num_beams": 2})
        result, error = responses.get(timeout=WAIT)
        assert result is None and error.message().startswith(
            "parameters.num_return_sequences: a stream (ModelStreamInfer) answers the best")
    finally:
        client.stop_stream()


@pytest.mark.parametrize(("inputs", "parameters", "named"), [
    (["seven"], {"top_p": 2.0, "do_sample": True}, "parameters.top_p must be in (0, 1]"),
    (["seven"], {"do_sample": "yes"}, "parameters.do_sample must be a boolean"),
    ([""], {}, "text[0] is empty"),
    (["seven"], {"source_language": 7}, "parameters.source_language must be a string"),
])
def test_each_bad_input_is_invalid_argument_naming_the_field(
        client: Any, inputs: list[str], parameters: dict, named: str) -> None:
    with pytest.raises(InferenceServerException) as raised:
        client.infer("demo", [text_input(inputs)], parameters=parameters)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert raised.value.message().startswith(named), raised.value.message()


def test_a_wrong_datatype_and_an_unknown_output(client: Any) -> None:
    numbers = grpcclient.InferInput("text", [1], "FP32")
    numbers.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with pytest.raises(InferenceServerException) as raised:
        client.infer("demo", [numbers])
    assert raised.value.message().startswith("inputs[0].datatype of 'text' must be BYTES")
    with pytest.raises(InferenceServerException) as raised:
        client.infer("demo", [text_input(["seven"])],
                     outputs=[grpcclient.InferRequestedOutput("embedding")])
    assert raised.value.message().startswith("outputs[0].name is 'embedding', not an output")


def test_auth_token_is_required_when_set(tmp_path: Path) -> None:
    with oip_server(oip_repository(tmp_path / "models"), "--auth-token", TOKEN) as secured:
        client = grpcclient.InferenceServerClient(grpc_url(secured))
        try:
            with pytest.raises(InferenceServerException) as raised:
                client.infer("demo", [text_input(["seven"])])
            assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
            result = client.infer("demo", [text_input(["seven"])],
                                  headers={"authorization": f"Bearer {TOKEN}"})
            assert decoded(result.as_numpy("translation")) == ["sept"]
        finally:
            client.close()



def test_calls_are_traced_as_the_protocols(client: Any, server: ServerThread) -> None:
    with spans_of(server) as exporter:
        client.infer("demo", [text_input(["seven"])], request_id="traced-oip",
                     headers={"traceparent": TRACEPARENT})
        span = one_span(server, exporter)
    assert span.name == "inference.GRPCInferenceService/ModelInfer"
    assert format(span.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    attributes = dict(span.attributes)
    assert (attributes["rpc.service"], attributes["rpc.method"]) == (
        "inference.GRPCInferenceService", "ModelInfer")
    assert (attributes["tfserve.request_id"], attributes["tfserve.model"],
            attributes["tfserve.status"]) == ("traced-oip", "demo", "OK")
