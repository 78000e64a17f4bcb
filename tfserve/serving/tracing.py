"""OpenTelemetry tracing of calls: one span per call, a child of the trace the client sent in
W3C `traceparent` / `tracestate` (gRPC metadata or HTTP headers), else a new trace.

Off unless asked for, by `--otel-endpoint` (TFSERVE_OTEL_ENDPOINT) or the standard
OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT. `start_tracing` then sets up
the OpenTelemetry SDK: spans go in batches to that OTLP endpoint (gRPC; `http/protobuf` when
OTEL_EXPORTER_OTLP_PROTOCOL says so), under the service name OTEL_SERVICE_NAME ("tfserve" by
default); the exporter's other standard variables (headers, certificates, timeouts) apply as
usual. Without the `tfserve[otel]` extra that is a RuntimeError naming the extra. When nothing
asks for tracing, nothing of opentelemetry is imported: this module imports it only inside
`start_tracing` and `Tracing`.

The scheduler's worker thread takes no part: it stamps a few moments of every request
(`tfserve.scheduler.JobTimes`), and when the call ends, on the event loop, `Tracing.end`
turns them into span events at those times: queued, taken, encoded, first_token, done.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tfserve.serving.status import Status

if TYPE_CHECKING:
    from tfserve.scheduler import Job

SERVICE = "tfserve.v1.Translator"  # the proto service: span names are SERVICE/<rpc>
DEFAULT_SERVICE_NAME = "tfserve"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# the JobTimes fields that become span events (of the same names), in the order they happen
EVENTS = ("queued", "taken", "encoded", "first_token", "done")
# the statuses that are errors on a gRPC server span (OpenTelemetry's semantic conventions
# for gRPC: the others are the client's doing); HTTP server spans: 5xx only
GRPC_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL",
                                "UNAVAILABLE", "DATA_LOSS"})

log = logging.getLogger("tfserve.server")

_provider: Any = None  # the SDK tracer provider start_tracing set up, once per process


def requested_by(endpoint: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """What asks for tracing ("--otel-endpoint" or the variable's name), or None: off."""
    environ = os.environ if environ is None else environ
    if endpoint:
        return "--otel-endpoint"
    return next((name for name in ENDPOINT_VARIABLES if environ.get(name)), None)


def start_tracing(endpoint: str | None) -> Tracing | None:
    """The server's tracing: None when nothing asks for it (`endpoint` is --otel-endpoint);
    else the SDK set up to export to the endpoint. RuntimeError when the extra is missing.

    The provider is set up once per process and made the global one, so that
    instrumentation the operator adds (grpc, logging) joins the same traces; when the
    process already has an SDK provider (`opentelemetry-instrument`), that one is used.
    """
    asked = requested_by(endpoint)
    if asked is None:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(f"tracing is asked for ({asked}) but OpenTelemetry is not installed "
                           f"(no module {exc.name}): pip install 'tfserve[otel]'") from None
    global _provider
    if _provider is None:
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            _provider = current
        else:
            service = os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
            provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
            # flushed at exit (the provider's atexit hook), so a drained server loses nothing
            provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
            trace.set_tracer_provider(provider)
            _provider = provider
    log.info("tracing", extra={"fields": {"event": "tracing", "asked_by": asked,
                                          "endpoint": endpoint or os.environ.get(asked, "")}})
    return Tracing(_provider.get_tracer("tfserve"))


def _exporter(endpoint: str | None) -> Any:
    """The OTLP span exporter for the protocol the standard variables name (gRPC by
    default); an `endpoint` given by flag wins over the variables' endpoint."""
    protocol = next((os.environ[name] for name in PROTOCOL_VARIABLES if os.environ.get(name)),
                    "grpc")
    kwargs = {"endpoint": endpoint} if endpoint else {}
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise RuntimeError("tracing over OTLP/gRPC needs opentelemetry-exporter-otlp-proto-"
                               "grpc: pip install 'tfserve[otel]'") from None
        return OTLPSpanExporter(**kwargs)
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpSpanExporter,
            )
        except ImportError:
            raise RuntimeError("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs "
                               "opentelemetry-exporter-otlp-proto-http (pip install "
                               "opentelemetry-exporter-otlp-proto-http)") from None
        if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            kwargs["endpoint"] = endpoint.rstrip("/") + "/v1/traces"  # as the variable means
        return HttpSpanExporter(**kwargs)
    raise RuntimeError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r}: tfserve exports traces over "
                       "grpc or http/protobuf")


def grpc_span_error(status: Status) -> bool:
    """Whether a gRPC server span that ends with `status` has span status ERROR."""
    return status.name in GRPC_SERVER_ERRORS


@dataclass
class CallSpan:
    """A call's span and the moment it started on two clocks: epoch nanoseconds (the span's)
    and time.perf_counter() seconds (the scheduler's JobTimes), read together."""

    span: Any
    start_ns: int
    start_perf: float

    def epoch_ns(self, moment: float) -> int:
        """A time.perf_counter() moment on the span's clock."""
        return self.start_ns + int((moment - self.start_perf) * 1e9)


class Tracing:
    """Starts and ends the calls' spans with one tracer.

    `start` takes the parent from the carrier through the global propagator (W3C trace
    context and baggage unless OTEL_PROPAGATORS says otherwise); without a carrier, or
    without a `traceparent` in it, the span starts a new trace.
    """

    def __init__(self, tracer: Any) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.context import Context

        self.tracer = tracer
        self._extract = propagate.extract
        self._empty = Context
        self._server = trace.SpanKind.SERVER
        self._error = lambda details: trace.Status(trace.StatusCode.ERROR, details)

    def start(self, name: str, rpc: str, request_id: str,
              carrier: Mapping[str, str] | None, service: str = SERVICE) -> CallSpan:
        """A started span for a call of `service`'s `rpc` that arrives now."""
        start_ns, start_perf = time.time_ns(), time.perf_counter()
        # an empty Context, not the loop's current one: with no traceparent, a new trace
        context = self._extract(carrier, context=self._empty()) if carrier else self._empty()
        span = self.tracer.start_span(
            name, context=context, kind=self._server, start_time=start_ns,
            attributes={"rpc.service": service, "rpc.method": rpc,
                        "tfserve.request_id": request_id})
        return CallSpan(span, start_ns, start_perf)

    def end(self, call_span: CallSpan, job: Job | None, texts: int, status: Status,
            details: str, error: bool | None = None, model: str = "") -> None:
        """End a call's span with its outcome; the job's moments become its events. `error`:
        whether the status is an error for this kind of span (default: the gRPC rule); the
        span status is then ERROR, described "CODE: message". `model`: the model it used."""
        span = call_span.span
        span.set_attributes({
            "tfserve.texts": texts,
            "tfserve.input_tokens": job.input_tokens if job is not None else 0,
            "tfserve.output_tokens": job.generated_tokens if job is not None else 0,
            "tfserve.status": status.name,
        })
        if model:
            span.set_attribute("tfserve.model", model)
        if job is not None:
            for event in EVENTS:
                moment = getattr(job.times, event)
                if moment is not None:
                    span.add_event(event, timestamp=call_span.epoch_ns(moment))
        if error is None:
            error = grpc_span_error(status)
        if error:
            span.set_status(self._error(f"{status.name}: {details}"))
        span.end()
