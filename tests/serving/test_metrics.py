"""The server's Prometheus exposition after real calls: time to first token, input tokens, the
standard process collectors, and no `*_created` series, in one process and with --workers.

A real server on loopback answers real gRPC calls; the metrics are read the way Prometheus
reads them, over HTTP from the metrics port, and parsed with prometheus_client's parser.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerProcess, ServerThread, free_port, server_args
from test_workers import free_ports

from tfserve.client import Client
from tfserve.text.translation_inputs import source_ids


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        return str(response.read().decode())


def values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture(scope="module")
def served(random_model: Path) -> Any:
    """A server that answered 3 Translate calls, 2 TranslateStream calls and 1 Encode call of
    known source lengths: its exposition as scraped afterwards, and the tokens sent by rpc."""
    with ServerThread(server_args(random_model, "--metrics-port", str(free_port()))) as server:
        eos = server.runtime.tokenizer.eos_id
        ids = [token for token in range(5, 30) if token != eos]
        sent = {"Translate": 0, "TranslateStream": 0}
        with Client(server.target, timeout=60) as client:
            for count in (1, 2, 3):  # 1, 2 and 3 texts of 2, 3 and 4 ids (eos appended)
                sources = [ids[:length] for length in range(2, 2 + count)]
                client.translate(token_ids=sources, max_new_tokens=3)
                sent["Translate"] += sum(len(source) + 1 for source in sources)
            for sources in ([ids[:4]], [ids[:2], ids[:6]]):
                list(client.translate_stream(token_ids=sources, max_new_tokens=3))
                sent["TranslateStream"] += sum(len(source) + 1 for source in sources)
            client.encode(["seven", "sixty"])
        runtime = server.runtime
        sent["Encode"] = sum(len(source) for source in source_ids(
            runtime.tokenizer, ["seven", "sixty"], None, runtime.max_source_positions))
        yield scrape(server.metrics_port), sent


def test_time_to_first_token_counts_every_translate_call(served: Any) -> None:
    text, _ = served
    samples = values(text)
    assert samples[("tfserve_time_to_first_token_seconds_count", (("rpc", "Translate"),))] == 3
    assert samples[("tfserve_time_to_first_token_seconds_count",
                    (("rpc", "TranslateStream"),))] == 2
    assert ("tfserve_time_to_first_token_seconds_count", (("rpc", "Encode"),)) not in samples
    for rpc in ("Translate", "TranslateStream"):
        ttft = samples[("tfserve_time_to_first_token_seconds_sum", (("rpc", rpc),))]
        total = samples[("tfserve_request_duration_seconds_sum", (("rpc", rpc),))]
        assert 0 < ttft < total  # the first token comes before the call's end


def test_input_tokens_are_the_tokens_sent(served: Any) -> None:
    text, sent = served
    samples = values(text)
    for rpc, tokens in sent.items():
        assert samples[("tfserve_input_tokens_total", (("rpc", rpc),))] == tokens
        assert samples[("tfserve_request_input_tokens_sum", (("rpc", rpc),))] == tokens
    assert samples[("tfserve_request_input_tokens_count", (("rpc", "Translate"),))] == 3


def test_process_series_and_no_created_series(served: Any) -> None:
    text, _ = served
    names = {name for name, _ in values(text)}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total",
                 "process_open_fds", "python_info", "python_gc_collections_total"):
        assert name in names, name
    assert not [line for line in text.splitlines() if "_created" in line]


def test_workers_expose_no_created_series(random_model: Path) -> None:
    """--workers: each worker (a spawned process) drops `*_created` and exposes its process
    series, as the parent's merged scrape shows."""
    metrics = free_ports(3)
    process = ServerProcess(server_args(random_model, "--workers", "2", "--metrics-port",
                                        str(metrics)))
    try:
        target = process.wait_serving(workers=2)
        with Client(target, timeout=60) as client:
            client.translate(["seven"], max_new_tokens=2)
        text = scrape(metrics)
    finally:
        process.kill()
    samples = values(text)
    for worker in ("0", "1"):
        assert samples[("tfserve_worker_up", (("worker", worker),))] == 1
        assert ("process_resident_memory_bytes", (("worker", worker),)) in samples
    assert sum(value for (name, _), value in samples.items()
               if name == "tfserve_time_to_first_token_seconds_count") == 1
    assert not [line for line in text.splitlines() if "_created" in line]
