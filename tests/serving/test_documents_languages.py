"""Documents on a multilingual model (issue 36): source_language "auto" (each document's
language detected once and mapped to the model's code), the Detect RPC and POST /v1/detect,
and the Python API's translate_document on the same model.

A tiny random NLLB-200-style checkpoint (four language codes: eng_Latn, fra_Latn, deu_Latn,
spa_Latn; tests/family_helpers.py) is exported with `python -m export --from-hf` and served.
Random weights translate nothing meaningful: the answers are compared with the same request
naming the language the detector finds. Nothing is downloaded; transformers is a test-only
dependency (skipped without it).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import grpc
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
pytest.importorskip("transformers")

import family_helpers as fh  # noqa: E402
from server_helpers import ServerThread, free_port, http_json, server_args  # noqa: E402

from export.cli import main as export_main  # noqa: E402
from tfserve.client import Client  # noqa: E402
from tfserve.proto import translator_pb2 as pb2  # noqa: E402
from tfserve.proto import translator_pb2_grpc as pb2_grpc  # noqa: E402
from tfserve.translator import Translator  # noqa: E402

FRENCH = ("Le chat dort sur le canapé. Il fait beau aujourd'hui, et nous allons nous "
          "promener dans le parc.")
ITALIAN = "Il gatto dorme sul divano. Oggi fa bel tempo e andiamo a passeggiare nel parco."
OPTIONS = {"numBeams": 1, "maxNewTokens": 6}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "nllb"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fh.write_checkpoint("nllb", directory, seed=0)
    out = tmp_path_factory.mktemp("artifacts") / "nllb"
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def server(model: Path) -> Any:
    with ServerThread(server_args(model, "--http-port", str(free_port()))) as running:
        yield running


def translate(server: ServerThread, texts: list[str], **fields: Any) -> tuple[int, Any]:
    body = {"texts": texts, "targetLanguage": "deu_Latn", "options": OPTIONS, **fields}
    return http_json(server, "POST", "/v1/translate", body, timeout=120)


def test_auto_detects_each_documents_language_once(server: ServerThread) -> None:
    status, answer = translate(server, [FRENCH], sourceLanguage="auto")
    assert status == 200, answer
    translation = answer["translations"][0]
    assert translation["detectedLanguage"] == "fra_Latn"
    assert 0.5 < translation["confidence"] <= 1.0
    assert len(translation["segments"]) == 2
    named = translate(server, [FRENCH], sourceLanguage="fra_Latn")[1]["translations"][0]
    assert named["hypotheses"] == translation["hypotheses"]
    assert "detectedLanguage" not in named


def test_auto_over_grpc_and_streamed(server: ServerThread) -> None:
    request = pb2.TranslateRequest(texts=[FRENCH], source_language="auto",
                                   target_language="deu_Latn",
                                   options=pb2.DecodingOptions(num_beams=1, max_new_tokens=6))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        reply = stub.Translate(request)
        chunks = list(stub.TranslateStream(request))
    assert reply.translations[0].detected_language == "fra_Latn"
    assert chunks[-1].done and chunks[-1].detected_language == "fra_Latn"
    assert chunks[-1].confidence == pytest.approx(reply.translations[0].confidence)
    assert "".join(c.text_delta for c in chunks) == reply.translations[0].hypotheses[0].text


@pytest.mark.parametrize(("text", "named"), [
    (ITALIAN, "texts[0] was detected as 'it'"),
    ("12345 !!! 678", "the language of the text cannot be detected"),
])
def test_auto_refusals_are_400_naming_the_language_or_why(server: ServerThread, text: str,
                                                          named: str) -> None:
    status, answer = translate(server, [text], sourceLanguage="auto")
    assert status == 400, answer
    assert answer["error"]["code"] == "INVALID_ARGUMENT"
    assert named in answer["error"]["message"]
    assert "source_language 'auto'" in answer["error"]["message"]


def test_detect_gives_iso_code_confidence_and_the_models_code(server: ServerThread) -> None:
    status, answer = http_json(server, "POST", "/v1/detect", {"texts": [FRENCH, ITALIAN]})
    assert status == 200, answer
    french, italian = answer["detections"]
    assert french["language"] == "fr" and french["modelLanguage"] == "fra_Latn"
    assert italian["language"] == "it" and "modelLanguage" not in italian
    assert 0 < french["confidence"] <= 1
    with grpc.insecure_channel(server.target) as channel:
        reply = pb2_grpc.TranslatorStub(channel).Detect(pb2.DetectRequest(texts=[FRENCH]))
    assert reply.detections[0].model_language == "fra_Latn"
    with Client(server.target, timeout=120) as client:
        [detection] = client.detect([ITALIAN])
    assert (detection.language, detection.model_language) == ("it", "")
    status, answer = http_json(server, "POST", "/v1/detect", {"texts": [FRENCH, "123"]})
    assert status == 400
    assert answer["error"]["message"].startswith("texts[1]: the language of the text cannot")


def test_translate_document_detects_and_matches_the_server(server: ServerThread,
                                                           model: Path) -> None:
    translator = Translator(model, intra_op_threads=1)
    document = translator.translate_document(FRENCH, source_language="auto",
                                             target_language="deu_Latn", num_beams=1,
                                             max_new_tokens=6)
    assert document.detected_language == "fra_Latn"
    served = translate(server, [FRENCH], sourceLanguage="auto")[1]["translations"][0]
    assert document.text == served["hypotheses"][0]["text"]
    assert document.confidence == pytest.approx(served["confidence"], abs=1e-6)
    with pytest.raises(ValueError, match="detected as 'it'"):
        translator.translate_document(ITALIAN, source_language="auto",
                                      target_language="deu_Latn")


def test_auto_on_html_reads_the_pages_text_not_its_markup(server: ServerThread) -> None:
    # an English script and English attribute values around French text: detected on the
    # raw page, the markup drags the confidence down to about a third
    script = ('var message = "the quick brown fox jumps over the lazy dog, and then the page '
              'says hello to every reader"; function hello() { return document.title; }')
    page = (f"<html><head><script>{script}</script><style>body {{ color: black; }}</style>"
            f'</head><body><p class="introduction">{FRENCH}</p></body></html>')
    status, answer = translate(server, [page], sourceLanguage="auto", format="html")
    assert status == 200, answer
    translation = answer["translations"][0]
    assert translation["detectedLanguage"] == "fra_Latn"
    assert translation["confidence"] > 0.9
