"""Prometheus metrics of the server and the scheduler (docs/server.md lists them).

Each `Metrics` owns its registry, so several servers (tests) can live in one process, and
`serve_http` exposes it on its own port. The scheduler updates the model-side metrics from its
worker thread; prometheus_client's metrics are thread-safe. The registry also carries the
standard process, platform and garbage-collector collectors (process_resident_memory_bytes,
process_cpu_seconds_total, python_gc_*), and no `*_created` series: they double the counters'
and histograms' lines for a value (the process start, near enough) no dashboard reads.

A server of a model repository (`--model-repository`) builds its Metrics with `by_model`: the
per-request and the scheduler series then carry a first label `model`, and each model's
scheduler writes through `for_model(name)`, a view with the same attributes bound to that
model's label. A `--model DIR` server keeps the series as they were, without the label. The
repository's own series (loads, unloads, memory, in-flight requests per model) always carry
it.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

# seconds: from a lone sub-millisecond step up to a long queue wait under overload
_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# source tokens of one request: one short text up to many texts at the source length limit
_TOKEN_BUCKETS = (4, 16, 64, 256, 1024, 4096, 16384, 65536)
# seconds: a demo-sized model loads in a fraction of a second, a large one in tens
_LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# the series a scheduler writes (tfserve.scheduler), each bound to one model by ModelMetrics:
# name -> whether it has labels besides `model` (set by the scheduler through .labels())
SCHEDULER_SERIES = {"queue_seconds": False, "batch_rows": False, "encoder_batch_rows": False,
                    "step_seconds": False, "generated_tokens": False, "decoder_steps": False,
                    "queue_depth": False, "freed_rows": True, "skipped_steps": True,
                    "model_errors": True}


class Metrics:
    """Every metric tfserve exports, registered in one private registry."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 by_model: bool = False) -> None:
        """`by_model`: the per-request and scheduler series carry a first label `model`."""
        # process-wide in prometheus_client, and read at every scrape: done here, it holds in
        # every process that serves metrics (each of --workers builds its own Metrics)
        disable_created_metrics()
        self.registry = registry or CollectorRegistry()
        self.by_model = by_model
        r = self.registry
        m = ["model"] if by_model else []
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter("tfserve_requests", "Finished RPCs by method and status code",
                                [*m, "rpc", "code"], registry=r)
        self.request_seconds = Histogram("tfserve_request_duration_seconds",
                                         "RPC wall time, by method", [*m, "rpc"],
                                         buckets=_TIME_BUCKETS, registry=r)
        self.time_to_first_token = Histogram(
            "tfserve_time_to_first_token_seconds",
            "From a call's arrival to its first generated token (unary: the step that decided "
            "it; streams: the first tokens handed to the stream), by method", [*m, "rpc"],
            buckets=_TIME_BUCKETS, registry=r)
        self.input_tokens = Counter("tfserve_input_tokens",
                                    "Source tokens of the requests the scheduler accepted, by "
                                    "method", [*m, "rpc"], registry=r)
        self.request_input_tokens = Histogram("tfserve_request_input_tokens",
                                              "Source tokens per accepted request, by method",
                                              [*m, "rpc"], buckets=_TOKEN_BUCKETS, registry=r)
        self.queue_seconds = Histogram("tfserve_queue_seconds",
                                       "Time an input waited before the model took it up",
                                       m, buckets=_TIME_BUCKETS, registry=r)
        self.batch_rows = Histogram("tfserve_decoder_batch_rows",
                                    "Rows (beams and samples count one each) per decoder step",
                                    m, buckets=_ROW_BUCKETS, registry=r)
        self.encoder_batch_rows = Histogram("tfserve_encoder_batch_rows",
                                            "Inputs per encoder run", m, buckets=_ROW_BUCKETS,
                                            registry=r)
        self.step_seconds = Histogram("tfserve_decoder_step_seconds",
                                      "Wall time of one decoder step (model run and search)",
                                      m, buckets=_TIME_BUCKETS, registry=r)
        self.generated_tokens = Counter("tfserve_generated_tokens",
                                        "Tokens in returned hypotheses (eos excluded)", m,
                                        registry=r)
        self.decoder_steps = Counter("tfserve_decoder_steps", "Decoder steps run", m,
                                     registry=r)
        self.in_flight = Gauge("tfserve_in_flight_requests", "RPCs being handled", registry=r)
        self.queue_depth = Gauge("tfserve_queue_depth",
                                 "Requests with inputs waiting for the model", m, registry=r)
        self.freed_rows = Counter("tfserve_freed_rows",
                                  "Decoder rows dropped early, by reason (cancelled, deadline)",
                                  [*m, "reason"], registry=r)
        self.skipped_steps = Counter(
            "tfserve_skipped_steps",
            "Decoder steps not run for dropped inputs (max_new_tokens minus steps taken), "
            "by reason", [*m, "reason"], registry=r)
        self.model_errors = Counter("tfserve_model_errors",
                                    "Failed model runs, by stage (encode, step)",
                                    [*m, "stage"], registry=r)
        # the model repository's own series, by model whatever the server
        self.model_loaded = Gauge("tfserve_model_loaded",
                                  "1 while a version of the model is loaded and serving",
                                  ["model"], registry=r)
        self.model_memory = Gauge("tfserve_model_memory_bytes",
                                  "Memory counted for the model's loaded versions against "
                                  "--max-model-memory (the size of their artifact files)",
                                  ["model"], registry=r)
        self.model_in_flight = Gauge("tfserve_model_in_flight_requests",
                                     "Requests in flight on the model (all its versions)",
                                     ["model"], registry=r)
        self.model_loads = Counter("tfserve_model_loads",
                                   "Model loads, by outcome (ok, failed)", ["model", "outcome"],
                                   registry=r)
        self.model_load_seconds = Histogram("tfserve_model_load_seconds",
                                            "Wall time of a model load that succeeded",
                                            ["model"], buckets=_LOAD_BUCKETS, registry=r)
        self.model_unloads = Counter("tfserve_model_unloads",
                                     "Model versions unloaded, by reason (lru, removed, "
                                     "replaced)", ["model", "reason"], registry=r)
        # the HTTP port's connections (tfserve.serving.http_server) and refused bearer tokens
        self.http_connections = Gauge("tfserve_http_connections",
                                      "HTTP connections open (counted against "
                                      "--http-max-connections)", registry=r)
        self.http_dropped = Counter("tfserve_http_connections_dropped",
                                    "HTTP connections the server closed, by reason (limit, "
                                    "header_timeout, body_timeout)", ["reason"], registry=r)
        self.auth_failures = Counter("tfserve_auth_failures",
                                     "Calls refused for their bearer token, by transport (grpc, "
                                     "http) and reason (missing, wrong, repeated)",
                                     ["transport", "reason"], registry=r)
        # the process's freed memory handed back after large requests (serving/calls.py)
        self.large_requests_trimmed = Counter(
            "tfserve_large_requests_trimmed",
            "Large requests (a message of 1 MiB or more) whose memory was handed back to the "
            "kernel after they ended", registry=r)
        self._http: Any = None
        self._http_thread: threading.Thread | None = None

    def for_model(self, name: str) -> Any:
        """What a model's scheduler writes its series through: this object itself when the
        series have no `model` label, else a ModelMetrics view bound to `name`."""
        return ModelMetrics(self, name) if self.by_model else self

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0.0 when it was never set), e.g. for tests."""
        found = self.registry.get_sample_value(name, labels or {})
        return float(found) if found is not None else 0.0

    def exposition(self) -> bytes:
        """The text format a scrape would read."""
        return generate_latest(self.registry)

    def serve_http(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose /metrics on host:port (0 picks a free port); returns the port."""
        self._http, self._http_thread = serve_registry(self.registry, port, host)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _ModelFamily:
    """A labelled family with its `model` label given: `.labels(reason)` is the family's
    `.labels(model, reason)`."""

    def __init__(self, family: Any, model: str) -> None:
        self.family = family
        self.model = model

    def labels(self, *values: str) -> Any:
        return self.family.labels(self.model, *values)


class ModelMetrics:
    """One model's view of a by_model Metrics: the attributes a scheduler uses
    (SCHEDULER_SERIES), each bound to this model's `model` label."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.registry = metrics.registry
        for name, labelled in SCHEDULER_SERIES.items():
            family = getattr(metrics, name)
            setattr(self, name, _ModelFamily(family, model) if labelled
                    else family.labels(model))

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample of this model's series (the `model` label added)."""
        return self.metrics.value(name, {"model": self.model, **(labels or {})})


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Scrapes are not logged (one line per scrape on stderr otherwise)."""


def metrics_only(app: Any) -> Any:
    """The WSGI app answering /metrics, and 404 on any other path: an HTTP probe pointed at
    this port by mistake (/healthz, /v2/health/ready) must fail, not read 200."""

    def wrapped(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO", "") not in ("/metrics", "/metrics/"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: the metrics are at /metrics\n"]
        return app(environ, start_response)

    return wrapped


def serve_registry(registry: Any, port: int, host: str) -> tuple[Any, threading.Thread]:
    """/metrics of `registry` on host:port; a busy port is an OSError naming --metrics-port."""
    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
    try:
        server = make_server(host.strip("[]"), port, metrics_only(make_wsgi_app(registry)),
                             server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise OSError(f"--metrics-port {port}: cannot listen on {host}:{port}: "
                      f"{exc.strerror or exc}") from None
    thread = threading.Thread(target=server.serve_forever, name="tfserve-metrics", daemon=True)
    thread.start()
    return server, thread


class WorkersCollector:
    """The metrics of every `--workers` process as one scrape, each sample labelled with its
    worker; `tfserve_worker_up` says which workers answered (one restarting does not)."""

    def __init__(self, urls: Sequence[str], timeout: float = 2.0) -> None:
        self.urls = list(urls)
        self.timeout = timeout

    def _fetch(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                return str(response.read().decode())
        except OSError:  # down or restarting
            return None

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        up = GaugeMetricFamily("tfserve_worker_up", "Whether the worker answered this scrape",
                               labels=["worker"])
        # all at once: a hung worker costs the scrape one timeout, not one per worker
        with ThreadPoolExecutor(len(self.urls)) as pool:
            texts = list(pool.map(self._fetch, self.urls))
        for index, text in enumerate(texts):
            worker = str(index)
            up.add_metric([worker], 0.0 if text is None else 1.0)
            if text is None:
                continue
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation,
                                                            family.type, family.unit)
                merged.samples += [sample._replace(labels={"worker": worker, **sample.labels})
                                   for sample in family.samples]
        yield up
        yield from families.values()


def serve_workers_metrics(urls: Sequence[str], port: int, host: str) -> Any:
    """/metrics on host:port gathering the workers' /metrics at `urls`; the HTTP server."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkersCollector(urls))  # type: ignore[arg-type]
    server, _ = serve_registry(registry, port, host)
    return server
