"""OpenTelemetry tracing: a real server on loopback, real gRPC clients, and the SDK's
in-memory exporter (or, end to end, a real OTLP receiver) reading the spans.

Each call's span is in the trace of the `traceparent` it sent (or a new one), carries the
call's attributes, and the events of its request's life in order. Without the SDK
(`pip install 'tfserve[otel]'`, or the dev extra) the span tests are skipped; the tests of
start-up (the missing extra, nothing imported when tracing is off) run either way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_helpers import ROOT, Gate, ServerProcess, ServerThread, free_port, server_args

from tfserve.client import Client, ServerError
from tfserve.serving.tracing import EVENTS, requested_by

needs_sdk = pytest.mark.skipif(
    find_spec("opentelemetry") is None or find_spec("opentelemetry.sdk") is None,
    reason="opentelemetry-sdk is not installed (pip install 'tfserve[otel]' or '.[dev]')")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
TRACESTATE = "congo=t61rcWkgMzE"


def env_without_otel() -> dict[str, str]:
    """This process's environment without OTEL_* variables, ROOT importable."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


# -- start-up -------------------------------------------------------------------------------


def test_what_asks_for_tracing() -> None:
    assert requested_by(None, {}) is None
    assert requested_by("", {"OTEL_SERVICE_NAME": "x"}) is None
    assert requested_by("http://collector:4317", {}) == "--otel-endpoint"
    assert requested_by(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == (
        "OTEL_EXPORTER_OTLP_ENDPOINT")
    assert requested_by(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}) == (
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def test_nothing_of_opentelemetry_is_imported_when_tracing_is_off(random_model: Path) -> None:
    """A server built and answering a call without tracing imports no opentelemetry module."""
    code = (
        "import sys\n"
        "from server_helpers import ServerThread, server_args\n"
        "from tfserve.client import Client\n"
        "with ServerThread(server_args(sys.argv[1])) as server:\n"
        "    with Client(server.target, timeout=60) as client:\n"
        "        client.translate(['seven'], max_new_tokens=2)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry'))\n")
    env = env_without_otel()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    done = subprocess.run([sys.executable, "-c", code, str(random_model)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_missing_extra_is_one_line_and_exit_2(random_model: Path) -> None:
    """Tracing asked for without OpenTelemetry installed: one line naming the extra, exit 2
    (opentelemetry is hidden from the child process whether or not it is installed here)."""
    code = ("import sys\n"
            "sys.modules['opentelemetry'] = None  # as if not installed\n"
            "from tfserve.server.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    argv = server_args(random_model, "--otel-endpoint", f"http://127.0.0.1:{free_port()}")
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env_without_otel(),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "--otel-endpoint" in lines[0] and "pip install 'tfserve[otel]'" in lines[0]


# -- spans ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced(random_model: Path) -> Iterator[tuple[ServerThread, Any]]:
    """A server whose calls' spans go to an in-memory exporter (synchronously, as each
    call ends, before its answer is sent)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tfserve.serving.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with ServerThread(server_args(random_model, "--max-batch-size", "8")) as server:
        server.server.core.calls.tracing = Tracing(provider.get_tracer("tfserve-test"))
        yield server, exporter
    provider.shutdown()


@pytest.fixture
def spans(traced: tuple[ServerThread, Any]) -> Iterator[Any]:
    """The exporter, emptied before the test."""
    exporter = traced[1]
    exporter.clear()
    yield exporter


def only_span(server: ServerThread, exporter: Any) -> Any:
    """The one span exported so far (waited for on the server's loop)."""
    server.wait_until(lambda: len(exporter.get_finished_spans()) >= 1)
    finished = exporter.get_finished_spans()
    assert len(finished) == 1, [span.name for span in finished]
    return finished[0]


def event_names_in_order(span: Any) -> list[str]:
    """The span's event names, checked to be in time order and within the span."""
    times = [event.timestamp for event in span.events]
    assert times == sorted(times), [(e.name, e.timestamp) for e in span.events]
    assert span.start_time <= times[0] and times[-1] <= span.end_time
    return [event.name for event in span.events]


@needs_sdk
def test_translate_span_continues_the_callers_trace(traced: tuple[ServerThread, Any],
                                                    spans: Any) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    server = traced[0]
    eos = server.runtime.tokenizer.eos_id
    sources = [[token for token in (5, 6, 7) if token != eos] or [5], [8, 9]]
    with Client(server.target, timeout=60) as client:
        client.metadata += [("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)]
        response = client.translate_response(token_ids=sources, max_new_tokens=3,
                                             request_id="traced-1")
    span = only_span(server, spans)
    assert span.name == "tfserve.v1.Translator/Translate"
    assert span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert span.parent.is_remote
    assert span.context.trace_state.to_header() == TRACESTATE
    output_tokens = sum(len(h.token_ids) for t in response.translations for h in t.hypotheses)
    assert output_tokens > 0
    assert dict(span.attributes) == {
        "rpc.service": "tfserve.v1.Translator", "rpc.method": "Translate",
        "tfserve.request_id": "traced-1", "tfserve.texts": 2,
        "tfserve.input_tokens": sum(len(source) + 1 for source in sources),  # eos appended
        "tfserve.output_tokens": output_tokens, "tfserve.status": "OK",
        "tfserve.model": server.repository.default_name}  # --model DIR: DIR's name
    assert span.status.status_code == StatusCode.UNSET  # success: the default, as specified
    assert event_names_in_order(span) == list(EVENTS)


@needs_sdk
def test_stream_span_has_the_decoding_events(traced: tuple[ServerThread, Any],
                                             spans: Any) -> None:
    server = traced[0]
    with Client(server.target, timeout=60) as client:
        client.metadata.append(("traceparent", TRACEPARENT))
        chunks = list(client.translate_stream(["seven", "twenty-one"], max_new_tokens=4))
    span = only_span(server, spans)
    assert span.name == "tfserve.v1.Translator/TranslateStream"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.attributes["tfserve.status"] == "OK"
    assert span.attributes["tfserve.texts"] == 2
    assert span.attributes["tfserve.output_tokens"] == sum(
        len(chunk.final.token_ids) for chunk in chunks if chunk.done)
    assert event_names_in_order(span) == list(EVENTS)


@needs_sdk
def test_encode_span_ends_with_its_encoder_run(traced: tuple[ServerThread, Any],
                                               spans: Any) -> None:
    server = traced[0]
    with Client(server.target, timeout=60) as client:
        client.encode(["seven", "sixty"])
    span = only_span(server, spans)
    assert span.name == "tfserve.v1.Translator/Encode"
    assert span.attributes["tfserve.output_tokens"] == 0
    assert event_names_in_order(span) == ["queued", "taken", "encoded", "done"]


@needs_sdk
def test_invalid_call_span_is_not_an_error(traced: tuple[ServerThread, Any],
                                            spans: Any) -> None:
    from opentelemetry.trace import StatusCode

    server = traced[0]
    with Client(server.target, timeout=60) as client:
        client.metadata.append(("traceparent", TRACEPARENT))
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"], num_beams=40)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    span = only_span(server, spans)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    # the client's error: not an error of a gRPC server span (OpenTelemetry's conventions)
    assert span.status.status_code == StatusCode.UNSET
    assert span.attributes["tfserve.status"] == "INVALID_ARGUMENT"
    assert span.attributes["tfserve.input_tokens"] == 0  # refused before the scheduler
    assert list(span.events) == []


@needs_sdk
def test_failed_model_run_span_has_the_events_up_to_the_failure(
        traced: tuple[ServerThread, Any], spans: Any) -> None:
    from opentelemetry.trace import StatusCode

    server = traced[0]
    with Gate(server.scheduler) as gate, Client(server.target, timeout=60) as client:
        gate.open()
        gate.fail_next("encode")
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"], max_new_tokens=3)
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    span = only_span(server, spans)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["tfserve.status"] == "INTERNAL"
    assert span.attributes["tfserve.input_tokens"] > 0
    assert event_names_in_order(span) == ["queued", "taken"]


@needs_sdk
def test_without_traceparent_each_call_starts_a_trace(traced: tuple[ServerThread, Any],
                                                      spans: Any) -> None:
    server = traced[0]
    with Client(server.target, timeout=60) as client:
        client.translate(["seven"], max_new_tokens=2)
        client.metadata.append(("traceparent", "00-not-a-valid-traceparent-01"))
        client.translate(["sixty"], max_new_tokens=2)
    server.wait_until(lambda: len(spans.get_finished_spans()) >= 2)
    first, second = spans.get_finished_spans()
    for span in (first, second):
        assert span.parent is None
        assert span.context.trace_id != int(TRACE_ID, 16)
    assert first.context.trace_id != second.context.trace_id


# -- end to end: the server's own exporter to an OTLP receiver ------------------------------


class Receiver:
    """An OTLP/gRPC trace receiver on loopback: the spans a collector would get."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        receiver = self
        self.requests: list[Any] = []
        self.received = threading.Event()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (grpc's name)
                receiver.requests.append(request)
                receiver.received.set()
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) for every span received."""
        out = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value
                            for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    out += [(resource, span) for span in scope_spans.spans]
        return out


@needs_sdk
@pytest.mark.skipif(find_spec("opentelemetry.exporter.otlp.proto.grpc") is None,
                    reason="opentelemetry-exporter-otlp-proto-grpc is not installed")
def test_server_exports_spans_over_otlp(random_model: Path) -> None:
    """`python -m tfserve serve --otel-endpoint`: the span of a call reaches an OTLP
    receiver under OTEL_SERVICE_NAME, at the latest when the drained server exits."""
    receiver = Receiver()
    env = env_without_otel()
    env["OTEL_SERVICE_NAME"] = "tfserve-under-test"
    process = ServerProcess(server_args(random_model, "--otel-endpoint",
                                        f"http://127.0.0.1:{receiver.port}"), env=env)
    try:
        target = process.wait_serving()
        assert process.wait_for(lambda r: r.get("event") == "tracing")["asked_by"] == (
            "--otel-endpoint")
        with Client(target, timeout=60) as client:
            client.metadata.append(("traceparent", TRACEPARENT))
            client.translate(["seven"], max_new_tokens=2)
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(60) == 0
    finally:
        process.kill()
        receiver.server.stop(0)
    (resource, span), = receiver.spans()
    assert resource["service.name"] == "tfserve-under-test"
    assert span.name == "tfserve.v1.Translator/Translate"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert [event.name for event in span.events] == list(EVENTS)
