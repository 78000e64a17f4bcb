"""End-to-end tests of the HTTP/JSON front end: a real server on loopback (gRPC and HTTP on one
event loop, one ServingCore), real HTTP clients (http.client, so that headers can repeat and a
connection can be dropped mid-stream).

The answers are compared with the gRPC side's for the same request: one schema, one core.
Every wait is for a state (a gate holding the model, a metric, the calls in flight).
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import pytest
from google.protobuf import json_format
from server_helpers import (
    ROOT,
    Gate,
    ProcessGate,
    ServerProcess,
    ServerThread,
    free_port,
    server_args,
    wait_queued,
)
from test_server import BAD_REQUESTS, past_every_deadline

from tfserve.client import Client, encode_request, translate_request
from tfserve.frontends.http_api import STATIC_ROUTE
from tfserve.frontends.http_server import HttpServer
from tfserve.frontends.oip_rest import ROUTES as OIP_ROUTES
from tfserve.proto import translator_pb2 as pb2
from tfserve.proto import translator_pb2_grpc as pb2_grpc

TEXTS = ["seven", "twenty-one", "three hundred and forty-two", "eight thousand and five"]
JSON = ("Content-Type", "application/json")


# -- a small HTTP client ----------------------------------------------------------------------


class Answer(NamedTuple):
    status: int
    headers: Any  # http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> tuple[str, str]:
        error = self.json()["error"]
        return error["code"], error["message"]


def connect(base: str, context: ssl.SSLContext | None = None) -> http.client.HTTPConnection:
    url = urlsplit(base)
    if url.scheme == "https":
        return http.client.HTTPSConnection(url.hostname, url.port, timeout=60, context=context)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=60)


def send(connection: http.client.HTTPConnection, method: str, path: str, body: Any = None,
         headers: tuple[tuple[str, str], ...] = (), raw: bytes | None = None) -> None:
    """Send a request: `body` as JSON (with its content type unless `headers` set one), or
    `raw` bytes as they are; headers may repeat."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    connection.putrequest(method, path)
    if data is not None:
        if not any(name.lower() == "content-type" for name, _ in headers):
            connection.putheader(*JSON)
        connection.putheader("Content-Length", str(len(data)))
    for name, value in headers:
        connection.putheader(name, value)
    connection.endheaders(data)


def request(base: str, method: str, path: str, body: Any = None,
            headers: tuple[tuple[str, str], ...] = (), raw: bytes | None = None,
            context: ssl.SSLContext | None = None) -> Answer:
    connection = connect(base, context)
    try:
        send(connection, method, path, body, headers, raw)
        response = connection.getresponse()
        return Answer(response.status, response.headers, response.read())
    finally:
        connection.close()


def events(response: http.client.HTTPResponse) -> Any:
    """Server-sent events as (event type, data) pairs, as they arrive."""
    kind, data = "message", []
    for raw_line in response:
        line = raw_line.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield kind, "\n".join(data)
            kind, data = "message", []
        elif line.startswith("event:"):
            kind = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].lstrip(" "))


def as_json(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message)


def without_id(document: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in document.items() if key != "requestId"}


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(random_model: Path) -> Any:
    from tfserve.runtime import Runtime

    return Runtime(random_model, intra_op_threads=1)


@pytest.fixture(scope="module")
def server(random_model: Path, runtime: Any) -> Any:
    with ServerThread(server_args(random_model, "--max-batch-size", "8", "--http-port",
                                  str(free_port())), runtime=runtime) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Any:
    with Client(server.target, timeout=60) as client:
        yield pb2_grpc.TranslatorStub(client.channel)


# -- the calls ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(texts=TEXTS, max_new_tokens=6),
    dict(texts=TEXTS[:2], num_beams=3, num_return_sequences=2, max_new_tokens=5),
    dict(texts=TEXTS[:2], do_sample=True, seed=7, num_return_sequences=2, max_new_tokens=5),
    dict(token_ids=[[5, 6, 7], [9]], max_new_tokens=4),
], ids=["greedy", "beams", "sampling", "token-ids"])
def test_translate_answers_as_grpc_does(server: ServerThread, stub: Any,
                                        kwargs: dict[str, Any]) -> None:
    message = translate_request(**kwargs)
    expected = as_json(stub.Translate(message, timeout=60))
    answer = request(server.http_url, "POST", "/v1/translate", as_json(message))
    assert answer.status == 200, answer.body
    assert answer.headers["Content-Type"].startswith("application/json")
    assert without_id(answer.json()) == without_id(expected)
    # proto field names are the JSON mapping's alternative spelling
    by_proto_names = json_format.MessageToDict(message, preserving_proto_field_name=True)
    again = request(server.http_url, "POST", "/v1/translate", by_proto_names)
    assert without_id(again.json()) == without_id(expected)


def test_stream_deltas_add_up_to_the_translation(server: ServerThread) -> None:
    options = dict(max_new_tokens=8)
    unary = request(server.http_url, "POST", "/v1/translate",
                    as_json(translate_request(TEXTS, **options))).json()
    connection = connect(server.http_url)
    send(connection, "POST", "/v1/translate:stream",
         as_json(translate_request(TEXTS, request_id="stream-1", **options)))
    response = connection.getresponse()
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["x-request-id"] == "stream-1"
    received = list(events(response))
    connection.close()
    assert received[-1] == ("done", "{}")
    chunks = [json.loads(data) for kind, data in received[:-1]]
    assert {kind for kind, _ in received[:-1]} == {"message"}
    for index, translation in enumerate(unary["translations"]):
        mine = [c for c in chunks if c.get("index", 0) == index]
        best = translation["hypotheses"][0]
        assert "".join(c.get("textDelta", "") for c in mine) == best.get("text", "")
        assert mine[-1]["done"] and mine[-1]["final"] == best
        assert [t for c in mine for t in c.get("tokenIds", [])] == best.get("tokenIds", [])
        assert sum(c.get("done", False) for c in mine) == 1
    assert all(c["requestId"] == "stream-1" for c in chunks)


def test_encode_and_model_info_answer_as_grpc_does(server: ServerThread, stub: Any) -> None:
    message = encode_request(TEXTS[:3], per_token=True)
    expected = as_json(stub.Encode(message, timeout=60))
    answer = request(server.http_url, "POST", "/v1/encode", as_json(message))
    assert answer.status == 200, answer.body
    assert without_id(answer.json()) == without_id(expected)
    model = request(server.http_url, "GET", "/v1/model")
    assert model.status == 200
    assert model.json() == as_json(stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=60))
    assert model.json()["limits"]["maxBatchSize"] == 8


def test_metrics_count_http_calls_by_rpc_and_status(server: ServerThread) -> None:
    def count(rpc: str, code: str) -> float:
        return server.metrics.value("tfserve_requests_total", {"rpc": rpc, "code": code})

    before = {key: count(*key) for key in (("Translate", "INVALID_ARGUMENT"), ("Encode", "OK"))}
    assert request(server.http_url, "POST", "/v1/translate", {"texts": []}).status == 400
    assert request(server.http_url, "POST", "/v1/encode", {"texts": ["seven"]}).status == 200
    assert count("Translate", "INVALID_ARGUMENT") == before[("Translate", "INVALID_ARGUMENT")] + 1
    assert count("Encode", "OK") == before[("Encode", "OK")] + 1
    answer = request(server.http_url, "GET", "/metrics")
    assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
    text = answer.body.decode()
    assert 'tfserve_requests_total{code="OK",rpc="Encode"}' in text
    assert "tfserve_in_flight_requests" in text


def test_request_id_is_echoed(server: ServerThread) -> None:
    body = as_json(translate_request(["seven"], max_new_tokens=2))
    answer = request(server.http_url, "POST", "/v1/translate", body,
                     headers=(("x-request-id", "from-header"),))
    assert answer.headers["x-request-id"] == "from-header"
    assert answer.json()["requestId"] == "from-header"
    body["requestId"] = "from-body"  # the message's field wins, as in gRPC
    answer = request(server.http_url, "POST", "/v1/translate", body,
                     headers=(("x-request-id", "from-header"),))
    assert answer.headers["x-request-id"] == answer.json()["requestId"] == "from-body"
    generated = request(server.http_url, "POST", "/v1/translate",
                        as_json(translate_request(["seven"], max_new_tokens=2)))
    assert len(generated.headers["x-request-id"]) == 32
    too_long = request(server.http_url, "POST", "/v1/translate",
                       as_json(translate_request(["seven"])), headers=(("x-request-id",
                                                                        "x" * 129),))
    assert too_long.status == 400 and "request_id is 129 characters" in too_long.error()[1]
    assert too_long.headers["x-request-id"]  # a generated one, on errors too


# -- errors ---------------------------------------------------------------------------------


def test_every_bad_input_is_a_400_naming_the_field(server: ServerThread) -> None:
    """The core's own checks (the gRPC tests' table), over HTTP: 400 INVALID_ARGUMENT with
    the same message, unary and streamed (a stream refused before its first event answers
    JSON, not events)."""
    for kwargs, message in BAD_REQUESTS:
        body = as_json(translate_request(**kwargs))
        for path in ("/v1/translate", "/v1/translate:stream"):
            answer = request(server.http_url, "POST", path, body)
            assert answer.status == 400, (path, kwargs, answer.body)
            assert answer.headers["Content-Type"].startswith("application/json")
            code, text = answer.error()
            assert code == "INVALID_ARGUMENT" and message in text, (kwargs, text)
    answer = request(server.http_url, "POST", "/v1/encode",
                     {"texts": ["seven"], "pooling": "median"})
    assert answer.status == 400 and "pooling must be one of" in answer.error()[1]


@pytest.mark.parametrize("raw, headers, message", [
    (b'{"texts": ["seven"', (JSON,), "not valid JSON"),
    (b'{"texts": ["\xff"]}', (JSON,), "not valid JSON"),
    (b'["seven"]', (JSON,), "must be a JSON object"),
    (b'{"texts": ["seven"]}', (("Content-Type", "text/plain"),), "Content-Type application/json"),
    (b'{"texts": ["seven"]}', (("Content-Type", ""),), "Content-Type application/json"),
    (b'{"text": ["seven"]}', (JSON,), 'no field named "text"'),
    (b'{"texts": "seven"}', (JSON,), "texts"),
    (b'{"texts": ["seven"], "options": {"maxNewTokens": "many"}}', (JSON,), "maxNewTokens"),
    (b'{"texts": ["seven"], "options": {"numBeams": 2.5}}', (JSON,), "numBeams"),
    (b'{"texts": ["seven"], "truncate": "yes"}', (JSON,), "truncate"),
    (b'{"texts": ["seven"], "options": 5}', (JSON,), "options"),
    (b"[" * 100_000 + b"]" * 100_000, (JSON,), "request body"),
    (b"", (JSON,), "not valid JSON"),
], ids=["truncated", "not-utf8", "array", "text-plain", "no-type", "unknown-field",
        "string-for-list", "string-for-int", "float-for-int", "string-for-bool",
        "number-for-message", "deeply-nested", "empty"])
def test_malformed_bodies_are_400s(server: ServerThread, raw: bytes,
                                   headers: tuple[tuple[str, str], ...], message: str) -> None:
    before = server.metrics.value("tfserve_requests_total",
                                  {"rpc": "Translate", "code": "INVALID_ARGUMENT"})
    answer = request(server.http_url, "POST", "/v1/translate", raw=raw, headers=headers)
    assert answer.status == 400, answer.body[:300]
    code, text = answer.error()
    assert code == "INVALID_ARGUMENT" and message in text, text
    assert server.metrics.value("tfserve_requests_total", {
        "rpc": "Translate", "code": "INVALID_ARGUMENT"}) == before + 1  # a call like others


def test_the_page_is_utf8_html(server: ServerThread) -> None:
    answer = request(server.http_url, "GET", "/")
    assert answer.status == 200
    assert answer.headers["Content-Type"] == "text/html; charset=utf-8"
    assert b"<html" in answer.body.lower()


def test_unknown_routes_and_wrong_methods_answer_json(server: ServerThread) -> None:
    answer = request(server.http_url, "GET", "/v1/nothing")
    assert answer.status == 404 and answer.error()[0] == "NOT_FOUND"
    assert "/v1/nothing" in answer.error()[1]
    for method, path, allowed in (("GET", "/v1/translate", "POST"),
                                  ("POST", "/healthz", "GET"), ("DELETE", "/v1/model", "GET")):
        answer = request(server.http_url, method, path)
        assert answer.status == 405, (method, path)
        assert answer.headers["Allow"] == allowed
        code, text = answer.error()
        assert code == "UNIMPLEMENTED" and "method not allowed" in text


def test_size_limits(random_model: Path, runtime: Any) -> None:
    """A body over --max-message-bytes is 413, read no further; an answer over it is
    RESOURCE_EXHAUSTED, as gRPC answers it."""
    with ServerThread(server_args(random_model, "--max-message-bytes", "2000", "--http-port",
                                  str(free_port())), runtime=runtime) as running:
        body = as_json(translate_request(["seven"] * 250))  # about 3 kB of JSON
        answer = request(running.http_url, "POST", "/v1/translate", body)
        assert answer.status == 413
        code, text = answer.error()
        assert code == "RESOURCE_EXHAUSTED" and "--max-message-bytes of 2000" in text
        big = request(running.http_url, "POST", "/v1/encode",
                      as_json(encode_request([TEXTS[2]] * 8, per_token=True)))
        assert big.status == 429
        code, text = big.error()
        assert code == "RESOURCE_EXHAUSTED" and "over the server's --max-message-bytes" in text
        ok = request(running.http_url, "POST", "/v1/translate",
                     as_json(translate_request(["seven"], max_new_tokens=2)))
        assert ok.status == 200
        assert running.metrics.value("tfserve_requests_total", {
            "rpc": "Translate", "code": "RESOURCE_EXHAUSTED"}) == 1


def test_bearer_token(random_model: Path, runtime: Any) -> None:
    with ServerThread(server_args(random_model, "--auth-token", "s3cret", "--http-port",
                                  str(free_port())), runtime=runtime) as running:
        url = running.http_url
        body = as_json(translate_request(["seven"], max_new_tokens=2))
        good = ("Authorization", "Bearer s3cret")
        for headers in ((), (("Authorization", "Bearer wrong"),), (good, good),
                        (("Authorization", "s3cret"),)):
            for method, path, payload in (("POST", "/v1/translate", body),
                                          ("POST", "/v1/translate:stream", body),
                                          ("POST", "/v1/encode", {"texts": ["seven"]}),
                                          ("GET", "/v1/model", None), ("GET", "/metrics", None),
                                          ("GET", "/openapi.json", None)):
                answer = request(url, method, path, payload, headers=headers)
                assert answer.status == 401, (headers, path)
                assert answer.error()[0] == "UNAUTHENTICATED"
                assert answer.headers["WWW-Authenticate"] == "Bearer"
        assert "more than one" in request(url, "GET", "/v1/model",
                                          headers=(good, good)).error()[1]
        assert request(url, "POST", "/v1/translate", body, headers=(good,)).status == 200
        assert request(url, "GET", "/metrics", headers=(good,)).status == 200
        for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
            assert request(url, "GET", path).status == 200, path  # the probes are exempt
        assert request(url, "GET", "/").status in (200, 404)  # the page: never 401
        assert request(url, "GET", "/v1/none").status == 404  # unknown stays unknown
        # refused before any call: nothing counted, as gRPC's interceptor refuses
        assert running.metrics.value("tfserve_requests_total", {
            "rpc": "Translate", "code": "OK"}) == 1


def test_full_queue_is_429(random_model: Path, runtime: Any) -> None:
    """The one row taken and --max-queue requests waiting (the worker held): the next is
    refused at once with 429 RESOURCE_EXHAUSTED; the others are answered."""
    with ServerThread(server_args(random_model, "--max-batch-size", "1", "--max-queue", "1",
                                  "--http-port", str(free_port())),
                      runtime=runtime) as running:
        body = as_json(translate_request(["seven"], max_new_tokens=3))
        with Gate(running.scheduler) as gate, ThreadPoolExecutor(2) as pool:
            first = pool.submit(request, running.http_url, "POST", "/v1/translate", body)
            gate.wait_held()
            queued = pool.submit(request, running.http_url, "POST", "/v1/translate", body)
            wait_queued(running.scheduler, 1)
            refused = request(running.http_url, "POST", "/v1/translate:stream", body)
            assert refused.status == 429 and refused.error()[0] == "RESOURCE_EXHAUSTED"
            assert "queue is full" in refused.error()[1]
            gate.open()
            assert first.result(60).status == 200 and queued.result(60).status == 200


def test_deadline_header(random_model: Path, runtime: Any) -> None:
    """x-request-timeout-ms is the call's deadline: a request whose deadline passes while it
    waits is 504 DEADLINE_EXCEEDED (the scheduler's clock set past it); a bad value is 400
    naming the header."""
    with ServerThread(server_args(random_model, "--max-batch-size", "1", "--http-port",
                                  str(free_port())), runtime=runtime) as running:
        url = running.http_url
        body = as_json(translate_request(["seven"], max_new_tokens=3))
        scheduler = running.scheduler
        with Gate(scheduler) as gate, ThreadPoolExecutor(2) as pool:
            busy = pool.submit(request, url, "POST", "/v1/translate",
                               as_json(translate_request(["seven"], max_new_tokens=20,
                                                         min_new_tokens=20)))
            gate.wait_held()
            expiring = pool.submit(request, url, "POST", "/v1/translate", body,
                                   (("x-request-timeout-ms", "60000"),))
            wait_queued(scheduler, 1)
            scheduler.clock = past_every_deadline
            gate.open()
            answer = expiring.result(60)
            scheduler.clock = time.monotonic
            assert answer.status == 504 and answer.error()[0] == "DEADLINE_EXCEEDED"
            assert busy.result(60).status == 200
        assert request(url, "POST", "/v1/translate", body,
                       (("x-request-timeout-ms", "60000"),)).status == 200
        for value in ("0", "-5", "+10", "1.5", "1e3", "soon", "86400001", ""):
            answer = request(url, "POST", "/v1/translate", body,
                             (("x-request-timeout-ms", value),))
            assert answer.status == 400, value
            assert "x-request-timeout-ms must be" in answer.error()[1], value
        twice = request(url, "POST", "/v1/translate", body, (("x-request-timeout-ms", "5000"),
                                                             ("x-request-timeout-ms", "6000")))
        assert twice.status == 400 and "several headers" in twice.error()[1]


# -- streams: errors and disconnects ---------------------------------------------------------


def first_token_has_text(url: str, candidates: list[str]) -> str:
    """An input whose first greedy token already decodes to text (so that a stream of it
    sends its first event after one decoder step): asked of the server, not guessed."""
    for text in candidates:
        answer = request(url, "POST", "/v1/translate", as_json(translate_request(
            [text], max_new_tokens=1, min_new_tokens=1))).json()
        if answer["translations"][0]["hypotheses"][0].get("text"):
            return text
    raise AssertionError("no candidate's first token has text")


def test_a_failure_after_the_first_event_is_an_error_event(server: ServerThread) -> None:
    text = first_token_has_text(server.http_url, TEXTS)
    connection = connect(server.http_url)
    with Gate(server.scheduler) as gate:
        send(connection, "POST", "/v1/translate:stream", as_json(translate_request(
            [text], max_new_tokens=50, min_new_tokens=50)))
        gate.wait_held()
        gate.step()  # the first token: the first event
        gate.wait_held()
        response = connection.getresponse()
        assert response.status == 200
        received = events(response)
        kind, data = next(received)
        assert kind == "message" and json.loads(data)["textDelta"]
        gate.fail_next("step")
        gate.open()
        rest = list(received)
    connection.close()
    kind, data = rest[-1]
    assert kind == "error"
    assert json.loads(data)["error"]["code"] == "INTERNAL"
    assert server.metrics.value("tfserve_requests_total",
                                {"rpc": "TranslateStream", "code": "INTERNAL"}) >= 1


def test_client_disconnect_cancels_the_stream(server: ServerThread) -> None:
    """A client that drops its connection mid-stream cancels its work as a cancelled gRPC
    call does: the call ends CANCELLED and its rows leave the batch before the next step."""
    text = first_token_has_text(server.http_url, TEXTS)
    scheduler = server.scheduler
    freed = scheduler.stats.freed_rows.get("cancelled", 0)
    cancelled = server.metrics.value("tfserve_requests_total",
                                     {"rpc": "TranslateStream", "code": "CANCELLED"})
    steps_before = scheduler.stats.steps
    connection = connect(server.http_url)
    with Gate(scheduler) as gate:
        send(connection, "POST", "/v1/translate:stream", as_json(translate_request(
            [text], max_new_tokens=100, min_new_tokens=100)))
        gate.wait_held()
        gate.step()
        gate.wait_held()  # decoding, held before its second step
        response = connection.getresponse()
        kind, data = next(events(response))
        assert kind == "message"
        # the client goes away (shut down, not just closed: the response object holds the
        # socket too)
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        server.wait_until(lambda: server.in_flight == 0)  # the server let it go
        assert server.metrics.value("tfserve_requests_total", {
            "rpc": "TranslateStream", "code": "CANCELLED"}) == cancelled + 1
        gate.open()
        server.wait_until(lambda: scheduler.idle)
    assert scheduler.stats.freed_rows.get("cancelled", 0) == freed + 1
    assert scheduler.stats.steps - steps_before < 100  # it did not decode on


def test_disconnect_under_uvloop(random_model: Path) -> None:
    """The real `python -m tfserve serve` (uvloop with --event-loop auto): a stream whose
    client goes away while the model is held ends CANCELLED at once (the handler is
    cancelled on the lost connection, not at its next write); the server then drains and
    exits 0 on SIGTERM."""
    pytest.importorskip("uvloop")
    with ProcessGate() as gate:
        port = free_port()
        process = ServerProcess([*server_args(random_model), "--http-port", str(port)],
                                gate=gate)
        try:
            process.wait_serving()
            assert process.wait_for(lambda r: r.get("event") == "serving")["event_loop"] == (
                "uvloop")
            gate.hold()
            connection = connect(f"http://127.0.0.1:{port}")
            send(connection, "POST", "/v1/translate:stream", as_json(translate_request(
                ["seven"], max_new_tokens=50, min_new_tokens=50, request_id="leaving")))
            gate.wait_held()  # decoding, held before a step
            connection.sock.shutdown(socket.SHUT_RDWR)
            connection.close()
            record = process.wait_for(lambda r: r.get("request_id") == "leaving")
            assert (record["rpc"], record["status"]) == ("TranslateStream", "CANCELLED")
            assert record["peer"].startswith("http:127.0.0.1:")
            gate.release()
            process.proc.send_signal(signal.SIGTERM)
            assert process.proc.wait(60) == 0
        finally:
            gate.release()
            process.kill()


# -- health, drain, the document ------------------------------------------------------------


def test_health_and_readiness_through_a_drain(random_model: Path, runtime: Any) -> None:
    """Live and ready while serving; on a drain ready is 503 and new calls are 503
    UNAVAILABLE while the call in flight (held by the gate) finishes and is answered."""
    running = ServerThread(server_args(random_model, "--http-port", str(free_port())),
                           runtime=runtime).start()
    url = running.http_url
    try:
        for path, body in (("/healthz", {"live": True}), ("/v2/health/live", {"live": True}),
                           ("/readyz", {"ready": True}), ("/v2/health/ready", {"ready": True})):
            answer = request(url, "GET", path)
            assert (answer.status, answer.json()) == (200, body), path
        with Gate(running.scheduler) as gate, ThreadPoolExecutor(2) as pool:
            in_flight = pool.submit(request, url, "POST", "/v1/translate",
                                    as_json(translate_request(["seven"], max_new_tokens=5)))
            gate.wait_held()
            drain = pool.submit(running.run_on_loop, running.server.drain, 60)
            running.wait_until(lambda: running.core.calls.draining)
            for path in ("/readyz", "/v2/health/ready"):
                answer = request(url, "GET", path)
                assert answer.status == 503 and answer.error()[0] == "UNAVAILABLE", path
            for path in ("/healthz", "/v2/health/live"):
                assert request(url, "GET", path).status == 200, path
            refused = request(url, "POST", "/v1/translate",
                              as_json(translate_request(["seven"])))
            assert refused.status == 503 and refused.error()[0] == "UNAVAILABLE"
            assert "shutting down" in refused.error()[1]
            gate.open()
            assert in_flight.result(60).status == 200
            drain.result(60)
        with pytest.raises(OSError):  # stopped: nobody listens any more
            request(url, "GET", "/healthz")
    finally:
        running.stop()


def test_openapi_documents_every_route(server: ServerThread) -> None:
    document = request(server.http_url, "GET", "/openapi.json").json()
    assert document["openapi"].startswith("3.")
    documented = {(method.upper(), path) for path, item in document["paths"].items()
                  for method in item}
    app = server.front_end(HttpServer).app
    routes = {(route.method, route.resource.canonical) for route in app.router.routes()}
    static = {(method, path) for method, path in routes if path in ("/", STATIC_ROUTE)}
    # the Open Inference Protocol's routes are the protocol's (docs/server.md)
    protocol = {(method, path) for method, path, _ in OIP_ROUTES}
    assert documented == routes - static - protocol
    assert ("POST", "/v1/translate:stream") in documented
    schemas = document["components"]["schemas"]
    assert {"texts", "tokenIds", "options", "requestId", "truncate", "model"} <= set(
        schemas["TranslateRequest"]["properties"])
    assert {field.json_name for field in pb2.TranslateRequest.DESCRIPTOR.fields} == set(
        schemas["TranslateRequest"]["properties"])
    assert schemas["ModelStatus"]["properties"]["state"]["enum"][1] == "MODEL_STATE_UNLOADED"
    assert document["paths"]["/v1/models/{name}"]["get"]["parameters"][0]["in"] == "path"
    assert schemas["Hypothesis"]["properties"]["tokenIds"]["items"]["type"] == "string"
    text = json.dumps(document)
    for reference in set(part.split('"')[0] for part in text.split("#/components/schemas/")[1:]):
        assert reference in schemas, reference


# -- TLS ------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl tool")
def test_tls_and_mutual_tls(random_model: Path, runtime: Any, tmp_path: Path) -> None:
    from test_hard_edges import _certificates

    files = _certificates(tmp_path)
    args = server_args(random_model, "--tls-cert", str(files["server.pem"]), "--tls-key",
                       str(files["server.key"]), "--http-port", str(free_port()))
    body = as_json(translate_request(["seven"], max_new_tokens=2))
    trusting = ssl.create_default_context(cafile=str(files["ca.pem"]))
    with ServerThread(args, runtime=runtime) as running:
        url = f"https://localhost:{running.http_port}"
        assert request(url, "POST", "/v1/translate", body, context=trusting).status == 200
        with pytest.raises(ssl.SSLError):  # a client that does not trust the CA
            request(url, "GET", "/healthz", context=ssl.create_default_context())
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # plaintext
            request(running.http_url, "GET", "/healthz")
    mutual = [*args, "--tls-client-ca", str(files["ca.pem"])]
    with ServerThread(mutual, runtime=runtime) as running:
        url = f"https://localhost:{running.http_port}"
        with pytest.raises((ssl.SSLError, ConnectionError)):  # no client certificate
            request(url, "GET", "/v1/model", context=trusting)
        trusting.load_cert_chain(files["client.pem"], files["client.key"])
        assert request(url, "GET", "/v1/model", context=trusting).status == 200


# -- the process: flags, workers, busy ports ------------------------------------------------


def test_http_port_setting() -> None:
    from tfserve.serving.settings import parse_config

    assert parse_config([], environ={}).http_port == 8080
    assert parse_config([], environ={"TFSERVE_HTTP_PORT": "0"}).http_port == 0
    assert parse_config(["--http-port", "9000"], environ={"TFSERVE_HTTP_PORT": "1"}).http_port \
        == 9000
    for bad in (["--http-port", "70000"], ["--http-port", "-1"],
                ["--port", "9000", "--http-port", "9000"],
                ["--metrics-port", "8080"]):
        with pytest.raises(SystemExit):
            parse_config(bad, environ={})


def test_http_port_0_leaves_http_off(random_model: Path, runtime: Any) -> None:
    with ServerThread(server_args(random_model), runtime=runtime) as running:
        assert running.front_end(HttpServer) is None and running.http_port == 0
        with Client(running.target, timeout=60) as client:  # gRPC serves as before
            assert len(client.translate(["seven"], max_new_tokens=2)) == 1


def test_workers_serve_http(random_model: Path) -> None:
    port = free_port()
    process = ServerProcess([*server_args(random_model), "--workers", "2", "--http-port",
                             str(port)])
    try:
        process.wait_serving(timeout=120, workers=2)
        serving = process.wait_for_all(lambda r: r.get("event") == "serving", 2)
        assert {record["http_port"] for record in serving} == {port}
        url = f"http://127.0.0.1:{port}"
        for _ in range(4):  # new connections each: the kernel spreads them
            answer = request(url, "POST", "/v1/translate",
                             as_json(translate_request(["seven"], max_new_tokens=2)))
            assert answer.status == 200, answer.body
        assert request(url, "GET", "/readyz").status == 200
    finally:
        process.proc.terminate()
        assert process.proc.wait(60) == 0
        process.kill()


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("flag", ["--http-port", "--port"])
def test_a_busy_port_is_one_clear_line(random_model: Path, workers: str, flag: str) -> None:
    """A held HTTP port, or a held gRPC port while HTTP is on (bound first, then stopped
    again): exit 2 naming the flag, no traceback."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"--http-port": str(free_port()), flag: str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "tfserve", "serve", *server_args(random_model),
             "--workers", workers, *(item for pair in ports.items() for item in pair)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{flag} {port}: cannot" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_loadgen_drives_both_transports(server: ServerThread,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.bench.loadgen import main

    http_target = f"127.0.0.1:{server.http_port}"
    code = main(["--server", server.target, "--http", http_target, "--concurrency", "1,3",
                 "--requests", "6", "--duration", "600", "--max-new-tokens", "3",
                 "--warmup", "1", "--processes", "1", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert code == 0
    assert [(r["transport"], r["concurrency"]) for r in rows] == [
        ("grpc", 1), ("http", 1), ("grpc", 3), ("http", 3)]
    assert all(r["requests"] == 6 and r["errors"] == 0 for r in rows)
    assert any(r["tokens"] for r in rows)
    # the same request mix: one client sends the same texts in the same order over both
    assert rows[0]["tokens"] == rows[1]["tokens"]
    code = main(["--http", http_target, "--transports", "http", "--rpc", "health",
                 "--concurrency", "2", "--requests", "10", "--duration", "600", "--warmup", "0",
                 "--processes", "1", "--json"])
    floor = json.loads(capsys.readouterr().out.strip())
    assert code == 0 and floor["transport"] == "http" and floor["requests"] == 10
    assert floor["errors"] == 0 and floor["tokens"] == 0
    assert main(["--transports", "http"]) == 2  # no --http
    assert main(["--http", "192.0.2.1:8080"]) == 2  # not loopback


def test_trace_context_comes_from_the_headers(random_model: Path, runtime: Any) -> None:
    """With tracing on, an HTTP call's span is named after its route and continues the trace
    of the W3C `traceparent` header."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tfserve.serving.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with ServerThread(server_args(random_model, "--http-port", str(free_port())),
                      runtime=runtime) as running:
        running.server.core.calls.tracing = Tracing(provider.get_tracer("tfserve-test"))
        answer = request(running.http_url, "POST", "/v1/translate",
                         as_json(translate_request(["seven"], max_new_tokens=2)),
                         (("traceparent", f"00-{trace_id}-{parent_id}-01"),))
        assert answer.status == 200
        # OpenTelemetry's rule for HTTP server spans: a 4xx answer is no error, a 5xx is
        answer = request(running.http_url, "POST", "/v1/translate",
                         as_json(translate_request(["seven"], num_beams=40)))
        assert answer.status == 400
        with Gate(running.scheduler) as gate:
            gate.open()
            gate.fail_next("encode")
            answer = request(running.http_url, "POST", "/v1/translate",
                             as_json(translate_request(["seven"], max_new_tokens=2)))
        assert answer.status == 500
        running.wait_until(lambda: len(exporter.get_finished_spans()) == 3)
    provider.shutdown()
    span, refused, failed = exporter.get_finished_spans()
    assert span.name == "POST /v1/translate"
    assert format(span.context.trace_id, "032x") == trace_id
    assert format(span.parent.span_id, "016x") == parent_id
    assert span.attributes["rpc.method"] == "Translate"
    from opentelemetry.trace import StatusCode

    assert refused.status.status_code == StatusCode.UNSET
    assert refused.attributes["tfserve.status"] == "INVALID_ARGUMENT"
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.status.description.startswith("INTERNAL: ")
