"""The HTTP front end's hard edges and its OpenAPI document: malformed JSON bodies are 400s
naming the problem, logged and counted like any call; the document served at /openapi.json
describes what the server answers, checked by schemathesis with its default checks against a
live server; the per-model readiness route keeps the models' names to authenticated callers.

A real server on loopback (tests/server_helpers.py), real HTTP clients
(tests/serving/test_http.py's).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import ServerThread, free_port, server_args, tfserve_records
from test_http import JSON, request

from tfserve.frontends.http_api import MAX_TIMEOUT_MS, TIMEOUT_HEADER
from tfserve.generation import DecodingOptions
from tfserve.serving.requests import MAX_REQUEST_ID_CHARS

MAX_TEXTS = 3  # --max-texts-per-request of the servers here: generated requests stay small


@pytest.fixture(scope="module")
def runtime(random_model: Path) -> Any:
    from tfserve.runtime import Runtime

    return Runtime(random_model, intra_op_threads=1)


@pytest.fixture(scope="module")
def server(random_model: Path, runtime: Any) -> Iterator[ServerThread]:
    with ServerThread(server_args(random_model, "--max-texts-per-request", str(MAX_TEXTS),
                                  "--http-port", str(free_port())), runtime=runtime) as running:
        yield running


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture,
           monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    return tfserve_records(caplog, monkeypatch)


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access log's records (their fields) captured so far."""
    return [record.fields for record in caplog.records  # type: ignore[attr-defined]
            if record.name == "tfserve.access"]


# -- malformed bodies -----------------------------------------------------------------------


@pytest.mark.parametrize("raw, message", [
    (b'{"\\ud800": 1}', "the field name '\\ud800' is not text (an unpaired surrogate)"),
    (b'{"texts": ["seven"], "options": {"\\udfff": 1}}', "options: the field name"),
    (b'{"texts": ["\\ud800"]}', "Unpaired surrogate"),
    (b'{"texts": ["seven"], "options": []}',
     "options must be a JSON object (a DecodingOptions), not an array"),
    (b'{"texts": ["seven"], "options": "greedy"}', "options must be a JSON object"),
    (b'{"tokenIds": [[5, 6]]}', "tokenIds[0] must be a JSON object (a TokenIds)"),
    (b'{"texts": ["seven"], "texts": ["eight"]}',
     "the request body gives the key 'texts' more than once"),
    (b'{"texts": ["seven"], "options": {"numBeams": 2, "numBeams": 3}}',
     "gives the key 'numBeams' more than once"),
    (b'{"texts": ["seven"], "options": {"numBeams": 2, "num_beams": 3}}',
     "options.num_beams: the field is given twice (also as 'numBeams')"),
], ids=["surrogate-key", "nested-surrogate-key", "surrogate-text", "array-for-options",
        "string-for-options", "array-for-token-ids", "duplicate-key", "nested-duplicate-key",
        "both-names"])
def test_malformed_bodies_are_400s_logged_and_counted(
        server: ServerThread, caplog: pytest.LogCaptureFixture, raw: bytes,
        message: str) -> None:
    counted = {"rpc": "Translate", "code": "INVALID_ARGUMENT"}
    before = server.metrics.value("tfserve_requests_total", counted)
    answer = request(server.http_url, "POST", "/v1/translate", raw=raw, headers=(JSON,),)
    assert answer.status == 400, answer.body[:300]
    code, text = answer.error()
    assert code == "INVALID_ARGUMENT" and message in text, text
    assert server.metrics.value("tfserve_requests_total", counted) == before + 1
    request_id = answer.headers["x-request-id"]
    assert [(r["rpc"], r["status"]) for r in access_records(caplog)
            if r["request_id"] == request_id] == [("Translate", "INVALID_ARGUMENT")]


# -- routes ---------------------------------------------------------------------------------


def test_static_files_that_are_not_served_are_not_found(server: ServerThread) -> None:
    """The playground's directory is not listed, and a file it lacks or one outside it is
    not served: NOT_FOUND (404) in the server's JSON errors, as for an unknown route."""
    for path in ("/static", "/static/", "/static/nothing.js", "/static/..%2Fhttp_api.py",
                 "/static/%2E%2E"):
        answer = request(server.http_url, "GET", path)
        assert answer.status == 404, path
        assert answer.headers["Content-Type"].startswith("application/json"), path
        assert answer.error()[0] == "NOT_FOUND", path
    page = request(server.http_url, "GET", "/static/index.html")
    assert page.status == 200 and b"<html" in page.body.lower()


def test_model_readiness_needs_the_token(random_model: Path, runtime: Any) -> None:
    """With --auth-token, /v2/models/{name}/ready is a model route like the others: 401
    without the token, so that its 404 (which names the models served) is only read by
    authenticated callers; the server's own probes stay open."""
    with ServerThread(server_args(random_model, "--auth-token", "s3cret", "--http-port",
                                  str(free_port())), runtime=runtime) as running:
        url, good = running.http_url, (("Authorization", "Bearer s3cret"),)
        for path in ("/v2/models/nothing/ready", "/v2/models/artifacts/ready"):
            answer = request(url, "GET", path)
            assert answer.status == 401, path
            assert answer.error()[0] == "UNAUTHENTICATED"
            assert "artifacts" not in answer.body.decode()
        missing = request(url, "GET", "/v2/models/nothing/ready", headers=good)
        assert missing.status == 404 and missing.error()[0] == "NOT_FOUND"
        assert "artifacts" in missing.error()[1]  # the models served, to a caller with the token
        ready = request(url, "GET", "/v2/models/artifacts/ready", headers=good)
        assert (ready.status, ready.json()["ready"]) == (200, True)
        for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
            assert request(url, "GET", path).status == 200, path
        document = request(url, "GET", "/openapi.json", headers=good).json()
        operation = document["paths"]["/v2/models/{name}/ready"]["get"]
        assert "security" not in operation and "401" in operation["responses"]


# -- the OpenAPI document -------------------------------------------------------------------


def test_the_document_carries_the_servers_limits(server: ServerThread) -> None:
    """The limits in the schemas are the checks' own (settings and the declared constants);
    probes answer JSON objects; every call documents its 400 (bad body or bad header)."""
    document = request(server.http_url, "GET", "/openapi.json").json()
    paths, schemas = document["paths"], document["components"]["schemas"]
    for path, key in (("/healthz", "live"), ("/readyz", "ready"), ("/v2/health/live", "live"),
                      ("/v2/health/ready", "ready")):
        schema = paths[path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["required"] == [key], path
        assert request(server.http_url, "GET", path).json() == {key: True}
    for path, item in paths.items():
        for method, operation in item.items():
            headers = {p["name"]: p["schema"] for p in operation.get("parameters", ())
                       if p["in"] == "header"}
            if headers:
                assert "400" in operation["responses"], (method, path)
                timeout = headers[TIMEOUT_HEADER]["pattern"]  # the range, exactly
                for value in ("1", "007", str(MAX_TIMEOUT_MS)):
                    assert re.fullmatch(timeout, value), value
                for value in ("0", str(MAX_TIMEOUT_MS + 1), "-5", "1.5", "1e3", ""):
                    assert not re.fullmatch(timeout, value), value
                rule = headers["x-request-id"]
                assert rule["maxLength"] == MAX_REQUEST_ID_CHARS
                assert re.fullmatch(rule["pattern"], "id-7 ~") and not re.fullmatch(
                    rule["pattern"], "caf\u00e9")
    assert {path for path, item in paths.items() for operation in item.values()
            if "parameters" in operation and any(p["in"] == "header"
                                                 for p in operation["parameters"])} == {
        "/v1/translate", "/v1/translate:stream", "/v1/encode", "/v1/detect", "/v1/model",
        "/v1/models", "/v1/models/{name}"}
    translate = schemas["TranslateRequest"]
    assert translate["additionalProperties"] is False
    assert translate["properties"]["texts"]["maxItems"] == MAX_TEXTS
    assert {"required": ["texts"]} .items() <= translate["anyOf"][0].items()
    assert translate["anyOf"][0]["properties"]["texts"]["minItems"] == 1
    assert schemas["EncodeRequest"]["required"] == ["texts"]
    options = schemas["DecodingOptions"]["properties"]
    assert options["numBeams"]["maximum"] == DecodingOptions.MAX_BEAMS
    assert options["temperature"]["maximum"] == DecodingOptions.MAX_TEMPERATURE


# -- schemathesis against the served document -----------------------------------------------

try:
    import schemathesis
    from hypothesis import HealthCheck, settings
except ImportError:  # the dev extra installs it
    schemathesis = None

# What a body the schema allows may still be refused for (400 naming the field): the model's
# own limits (source and target length, vocabulary, languages) and the rules between fields
# (min_new_tokens <= max_new_tokens, num_return_sequences <= num_beams, no beams when
# sampling, one target prefix per text, token_ids without source_language), which JSON
# schema cannot say. Any other refusal of a schema-valid body fails the run.
MODEL_RULES = re.compile("|".join((
    r"texts\[\d+\] is \d+ (tokens|characters), over the limit",
    r"token_ids\[\d+\]",
    r"(source|target)_language ",
    r"target_prefix",
    r"options\.(max_new_tokens|min_new_tokens|num_return_sequences) must be",
    r"options\.num_beams must be 1 when do_sample",
    # documents (tfserve.serving.documents): markup without text, a rule between fields,
    # the sentences a text splits into, a text whose language cannot be detected
    r"texts\[\d+\] holds no text to translate",
    r"format 'html' needs split_sentences",
    r"texts\[\d+\]: text has more than \d+ sentences|texts split into more than",
    r"texts\[\d+\]: the language of the text cannot be detected",
)))


def refused_only_for_model_rules(ctx: Any, response: Any, case: Any) -> bool | None:
    """A check beside schemathesis' defaults: a body the schema allows that is answered 400
    was refused for one of MODEL_RULES."""
    if case.meta is None or not case.meta.generation.mode.is_positive or (
            response.status_code != 400):
        return None
    message = response.json()["error"]["message"]
    assert MODEL_RULES.match(message), f"a body the document allows was refused: {message}"
    return True


@pytest.fixture
def served_schema(server: ServerThread) -> Any:
    """The document as the server serves it, loaded by schemathesis with its default checks,
    tuned for what the document states: 504 answers the client's own x-request-timeout-ms
    (generated down to 1 ms), so it is no server error, nor a refusal of a request the
    schema forbids (such a request is refused before its deadline counts, or it was taken:
    200 or 504 as the clock goes, a failure either way); and a body may be refused for a
    model's own limit (refused_only_for_model_rules checks which)."""
    from schemathesis.config import SchemathesisConfig

    config = SchemathesisConfig.from_dict({
        "checks": {
            "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "504"]},
            "negative_data_rejection": {"expected-statuses": [
                "400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428",
                "429"]},
        },
        "operations": [{"include-method": "POST", "checks": {"positive_data_acceptance": {
            "expected-statuses": ["2xx", "400", "401", "404", "429", "5xx"]}}}],
    })
    return schemathesis.openapi.from_url(f"{server.http_url}/openapi.json", config=config)


if schemathesis is not None:
    served = schemathesis.pytest.from_fixture("served_schema")

    @served.parametrize()
    @settings(max_examples=25, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    def test_schemathesis_finds_the_document_true(case: Any) -> None:
        case.call_and_validate(additional_checks=[refused_only_for_model_rules])
else:
    def test_schemathesis_finds_the_document_true() -> None:
        pytest.skip("needs schemathesis (pip install -e '.[ecosystem]')")
