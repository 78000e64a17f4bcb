"""The Open Inference Protocol over HTTP (tfserve.frontends.oip_rest), driven by the real
clients: tritonclient.http (sync and async infer, JSON and binary tensor data, metadata,
readiness, errors) and KServe's InferenceRESTClient and InferenceGRPCClient (in a process of
their own: kserve and tritonclient.grpc register the same protobuf names, so one process
cannot import both).

The server serves a repository of two models: the trained demo (English -> French) and a
small encoder model.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from oip_helpers import (
    FRENCH,
    TEXTS,
    TOKEN,
    grpc_url,
    http_url,
    oip_repository,
    oip_server,
    one_span,
    served,  # noqa: F401 (the `server` fixture)
    spans_of,
)
from server_helpers import ServerThread, demo_trained

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.skipif(not demo_trained(), reason="the demo checkpoint is not trained")


@pytest.fixture
def client(server: ServerThread) -> Iterator[object]:
    with httpclient.InferenceServerClient(http_url(server), concurrency=4) as made:
        yield made


def text_input(texts: list[str], name: str = "text", binary: bool = True) -> object:
    tensor = httpclient.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_),
                               binary_data=binary)
    return tensor


def decoded(array: np.ndarray) -> list[str]:
    """BYTES elements as text (tritonclient gives bytes for binary data, str for JSON)."""
    return [value.decode() if isinstance(value, bytes) else value for value in array.ravel()]


def metric(server: ServerThread, rpc: str, code: str) -> float:
    return server.metrics.value("tfserve_requests_total",
                                {"model": "demo", "rpc": rpc, "code": code})


def test_server_and_model_metadata_and_readiness(client: object, server: ServerThread) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("demo") and client.is_model_ready("encoder")
    assert not client.is_model_ready("missing")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "tfserve" and "binary_tensor_data" in metadata["extensions"]
    demo = client.get_model_metadata("demo")
    assert demo["name"] == "demo" and demo["platform"] == "tfserve"
    (version,) = demo["versions"]
    assert demo["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]},
                              {"name": "target_prefix", "datatype": "BYTES", "shape": [-1]}]
    assert demo["outputs"] == [{"name": "translation", "datatype": "BYTES", "shape": [-1]},
                               {"name": "score", "datatype": "FP32", "shape": [-1]}]
    assert client.get_model_metadata("demo", version)["versions"] == [version]
    assert client.is_model_ready("demo", version)
    encoder = client.get_model_metadata("encoder")
    assert [tensor["name"] for tensor in encoder["inputs"]] == ["text"]
    assert encoder["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 32]}]
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("demo", "0000")
    assert raised.value.status() == "404" and "has no version '0000'" in raised.value.message()


@pytest.mark.parametrize("binary", [True, False])
def test_infer_translates(client: object, server: ServerThread, binary: bool) -> None:
    before = metric(server, "ModelInfer", "OK")
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary)
               for name in ("translation", "score")]
    result = client.infer("demo", [text_input(TEXTS, binary=binary)], outputs=outputs,
                          request_id="oip-1")
    assert decoded(result.as_numpy("translation")) == FRENCH
    scores = result.as_numpy("score")
    assert scores.dtype == np.float32 and scores.shape == (2,) and (scores < 0).all()
    response = result.get_response()
    assert response["id"] == "oip-1" and response["model_name"] == "demo"
    assert response["model_version"] == client.get_model_metadata("demo")["versions"][0]
    assert metric(server, "ModelInfer", "OK") == before + 1


def test_infer_takes_parameters_and_the_prefix_input(client: object) -> None:
    # every output without asking (binary_data_output), n-best as [N, K]
    result = client.infer("demo", [text_input(TEXTS)],
                          parameters={"num_beams": 4, "num_return_sequences": 2})
    translations = result.as_numpy("translation")
    assert translations.shape == (2, 2) and decoded(translations[:, 0]) == FRENCH
    assert result.as_numpy("score").shape == (2, 2)
    # a target prefix as an input, one per text
    result = client.infer("demo", [text_input(["seven", "eight"]),
                                   text_input(["sept", "huit"], "target_prefix")],
                          parameters={"max_new_tokens": 16})
    assert decoded(result.as_numpy("translation")) == ["sept", "huit"]


def test_async_infer(client: object) -> None:
    pending = [client.async_infer("demo", [text_input([text])]) for text in TEXTS]
    assert [decoded(request.get_result(timeout=120).as_numpy("translation"))[0]
            for request in pending] == FRENCH


def test_the_aio_client(server: ServerThread) -> None:
    """tritonclient.http.aio sends its requests as application/octet-stream, JSON or not."""
    aio = pytest.importorskip("tritonclient.http.aio")
    import asyncio

    async def infer() -> list[list[str]]:
        async with aio.InferenceServerClient(http_url(server)) as made:
            found = []
            for binary in (False, True):
                tensor = aio.InferInput("text", [len(TEXTS)], "BYTES")
                tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS],
                                                    dtype=np.object_), binary_data=binary)
                result = await made.infer("demo", [tensor])
                found.append(decoded(result.as_numpy("translation")))
            return found

    assert asyncio.run(infer()) == [FRENCH, FRENCH]


def test_encoder_model_gives_embeddings(client: object) -> None:
    result = client.infer("encoder", [text_input(TEXTS)], parameters={"pooling": "max"})
    embeddings = result.as_numpy("embedding")
    assert embeddings.dtype == np.float32 and embeddings.shape == (2, 32)
    assert np.isfinite(embeddings).all() and not np.allclose(embeddings[0], embeddings[1])


@pytest.mark.parametrize(("parameters", "inputs", "named"), [
    ({"num_beams": 40}, None, "parameters.num_beams must be in [1, 16], got 40"),
    ({"num_beams": "four"}, None, "parameters.num_beams must be an integer, got 'four'"),
    ({"beams": 4}, None, "parameters.beams is not a parameter of this model"),
    ({"target_language": "de"}, None, "parameters.target_language"),
    ({}, [""], "text[0] is empty"),
    ({}, "texts", "inputs[0].name is 'texts', not an input of this model"),
    ({"pooling": "max"}, None, "parameters.pooling is not a parameter of this model"),
])
def test_each_bad_input_is_a_400_naming_the_field(client: object, parameters: dict,
                                                   inputs: object, named: str) -> None:
    if inputs == "texts":
        given = [text_input(["seven"], name="texts")]
    else:
        given = [text_input(inputs or ["seven"])]
    with pytest.raises(InferenceServerException) as raised:
        client.infer("demo", given, parameters=parameters)
    assert raised.value.status() == "400", raised.value
    assert raised.value.message().startswith(named), raised.value.message()


def test_errors_of_the_route(client: object, server: ServerThread) -> None:
    with pytest.raises(InferenceServerException) as raised:
        client.infer("missing", [text_input(["seven"])])
    assert raised.value.status() == "404" and "not served here" in raised.value.message()
    version = client.get_model_metadata("demo")["versions"][0]
    answered = client.infer("demo", [text_input(["seven"])], model_version=version)
    assert answered.get_response()["model_version"] == version
    with pytest.raises(InferenceServerException) as raised:
        client.infer("demo", [text_input(["seven"])], model_version="1")
    assert raised.value.status() == "404"
    assert raised.value.message() == f"model 'demo' has no version '1': its version is {version!r}"
    # a deadline of one microsecond (Triton's `timeout` parameter) has passed in the queue
    with pytest.raises(InferenceServerException) as raised:
        client.infer("demo", [text_input(["seven"])], timeout=1)
    assert raised.value.status() == "504", raised.value
    # a body that is not JSON: the protocol's error object, the native API's status
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.http_url + "/v2/models/demo/infer", data=b"{",
                                     method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(request, timeout=60)
    assert failed.value.code == 400
    assert json.loads(failed.value.read())["error"].startswith("the request body is not valid")
    # a form's Content-Type (urllib's for a POST, and curl -d's) is not the protocol's
    request = urllib.request.Request(server.http_url + "/v2/models/demo/infer", data=b"{}",
                                     method="POST")
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(request, timeout=60)
    assert failed.value.code == 400
    assert json.loads(failed.value.read())["error"] == (
        "the request body must be the protocol's JSON (Content-Type application/json), or JSON "
        "and binary tensor data (application/octet-stream), got "
        "'application/x-www-form-urlencoded'")


def test_calls_are_traced_and_carry_their_request_id(client: object,
                                                     server: ServerThread) -> None:
    with spans_of(server) as exporter:
        result = client.infer("demo", [text_input(["seven"])], request_id="rest-traced")
        span = one_span(server, exporter)
    assert result.get_response()["id"] == "rest-traced"
    assert span.name == "POST /v2/models/demo/infer"
    attributes = dict(span.attributes)
    assert (attributes["rpc.service"], attributes["rpc.method"]) == (
        "inference.GRPCInferenceService", "ModelInfer")
    assert attributes["tfserve.request_id"] == "rest-traced"


def test_auth_token_is_required_when_set(tmp_path: Path) -> None:
    with oip_server(oip_repository(tmp_path / "models"), "--auth-token", TOKEN) as secured, \
            httpclient.InferenceServerClient(http_url(secured)) as client:
        assert client.is_server_live() and client.is_server_ready()  # the probes are open
        with pytest.raises(InferenceServerException) as raised:
            client.infer("demo", [text_input(["seven"])])
        assert raised.value.status() == "401"
        assert raised.value.message() == \
            "missing or wrong bearer token in the Authorization header"  # the protocol's body
        result = client.infer("demo", [text_input(["seven"])],
                              headers={"Authorization": f"Bearer {TOKEN}"})
        assert decoded(result.as_numpy("translation")) == ["sept"]
        version = client.get_model_metadata("demo", headers={
            "Authorization": f"Bearer {TOKEN}"})["versions"][0]
        assert_401_shapes(secured, version)


def assert_401_shapes(server: ServerThread, version: str) -> None:
    """The protocol's routes answer 401 in its shape; the per-model probe, versioned or not,
    is the native API's route, and answers every failure (401, 404, 503) in the native
    shape."""
    import urllib.error
    import urllib.request

    def refused(path: str) -> object:
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(server.http_url + path, timeout=60)
        assert failed.value.code == 401, path
        return json.loads(failed.value.read())["error"]

    for path in ("/v2", "/v2/models/demo", f"/v2/models/demo/versions/{version}"):
        assert refused(path) == "missing or wrong bearer token in the Authorization header"
    for path in ("/v2/models/demo/ready", f"/v2/models/demo/versions/{version}/ready",
                 "/v2/models/missing/versions/1/ready"):
        assert refused(path) == {"code": "UNAUTHENTICATED", "message":
                                 "missing or wrong bearer token in the Authorization header"}


KSERVE_CLIENTS = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

http_url, grpc_url = sys.argv[1], sys.argv[2]
texts = json.loads(sys.argv[3])

def request(model, parameters=None):
    tensor = InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return InferRequest(model_name=model, infer_inputs=[tensor], request_id="kserve-1",
                        parameters=parameters)

async def main():
    found = {}
    rest = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
    found["rest_live"] = await rest.is_server_live(http_url)
    found["rest_ready"] = await rest.is_server_ready(http_url)
    found["rest_model_ready"] = await rest.is_model_ready(http_url, "demo")
    answer = await rest.infer(http_url, request("demo"), model_name="demo")
    found["rest"] = [output.as_numpy().tolist() for output in answer.outputs]
    found["rest_names"] = [output.name for output in answer.outputs]
    found["rest_id"] = answer.id
    try:
        await rest.infer(http_url, request("demo", {"num_beams": 40}), model_name="demo")
    except Exception as exc:
        found["rest_error"] = str(exc)
    await rest.close()
    grpc = InferenceGRPCClient(grpc_url)
    found["grpc_ready"] = await grpc.is_server_ready()
    found["grpc_model_ready"] = await grpc.is_model_ready("demo")
    answer = await grpc.infer(request("demo"))
    found["grpc"] = [output.as_numpy().tolist() for output in answer.outputs]
    found["grpc_id"] = answer.id
    encoded = await grpc.infer(request("encoder"))
    found["grpc_embedding_shape"] = list(encoded.outputs[0].as_numpy().shape)
    await grpc.close()
    print(json.dumps(found, default=lambda value: value.decode()))

asyncio.run(main())
"""


def test_kserve_clients(server: ServerThread) -> None:
    """KServe's SDK: InferenceRESTClient and InferenceGRPCClient (its own `inference`
    stubs) against both transports of one server."""
    if importlib.util.find_spec("kserve") is None:  # not imported here: see the docstring
        pytest.skip("kserve is not installed")
    done = subprocess.run([sys.executable, "-c", KSERVE_CLIENTS, server.http_url,
                           grpc_url(server), json.dumps(TEXTS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["rest_live"] and found["rest_ready"] and found["rest_model_ready"]
    assert found["rest_names"] == ["translation", "score"]
    assert found["rest"][0] == FRENCH and found["rest_id"] == "kserve-1"
    assert "parameters.num_beams must be in [1, 16], got 40" in found["rest_error"]
    assert "400" in found["rest_error"]
    assert found["grpc_ready"] and found["grpc_model_ready"]
    assert found["grpc"][0] == FRENCH and found["grpc_id"] == "kserve-1"
    assert found["grpc_embedding_shape"] == [2, 32]
