"""Documents through the Open Inference Protocol (issue 36): the translate parameters
split_sentences and format reach the core (every text a document by default), over REST.

The server serves the demo (tests/oip_helpers.py's repository); the answers are compared with
the native HTTP API's for the same request.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from oip_helpers import served  # noqa: F401 (the `server` fixture)
from server_helpers import ServerThread, http_json

DOCUMENT = "seven. twenty-one.\n\n  eight."


def infer(server: ServerThread, texts: list[str], **parameters: Any) -> tuple[int, Any]:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                        "data": texts}],
            "parameters": {"num_beams": 1, **parameters}}
    request = urllib.request.Request(server.http_url + "/v2/models/demo/infer",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def native(server: ServerThread, texts: list[str], **fields: Any) -> list[str]:
    status, answer = http_json(server, "POST", "/v1/translate",
                               {"texts": texts, "model": "demo", "options": {"numBeams": 1},
                                **fields}, timeout=120)
    assert status == 200, answer
    return [t["hypotheses"][0].get("text", "") for t in answer["translations"]]


def translations(answer: dict[str, Any]) -> list[str]:
    return next(o["data"] for o in answer["outputs"] if o["name"] == "translation")


@pytest.mark.parametrize(("parameters", "fields"), [
    ({}, {}),
    ({"split_sentences": False}, {"splitSentences": False}),
    ({"format": "html"}, {"format": "html"}),
])
def test_document_parameters_reach_the_core(server: ServerThread, parameters: dict[str, Any],
                                            fields: dict[str, Any]) -> None:
    texts = [DOCUMENT if "format" not in parameters else "<p>seven. <b>eight</b>.</p>"]
    status, answer = infer(server, texts, **parameters)
    assert status == 200, answer
    assert translations(answer) == native(server, texts, **fields)


def test_an_unknown_format_names_the_parameter(server: ServerThread) -> None:
    status, answer = infer(server, [DOCUMENT], format="markdown")
    assert status == 400
    assert answer["error"].startswith("parameters.format must be one of text, html")


def test_a_documents_stream_chunk_carries_its_segment_and_detection() -> None:
    """ModelStreamInfer's parameters of a document's chunks (the gRPC response's types)."""
    from tfserve.frontends.oip_grpc import infer_response
    from tfserve.frontends.oip_tensors import chunk_outputs
    from tfserve.serving import Chunk, DetectedLanguage, TextHypothesis

    _, parameters = chunk_outputs(Chunk(0, " x", [5], segment=2, separator=" "))
    assert parameters == {"index": 0, "done": False, "segment": 2}
    outputs, parameters = chunk_outputs(Chunk(
        0, "", [], done=True, final=TextHypothesis("x", [5], -1.0), segment=2,
        detected=DetectedLanguage("fra_Latn", "fr", 0.75)))
    assert parameters["detected_language"] == "fra_Latn"
    response = infer_response(outputs, "demo", "1", "id", parameters)
    assert response.parameters["confidence"].double_param == 0.75
    assert response.parameters["detected_language"].string_param == "fra_Latn"
