"""Fixtures of the Open Inference Protocol tests (tests/frontends/test_oip_*.py): a model
repository of two models, the trained demo (a translation model) and a small random encoder
model, each exported once per test session, and a server on loopback serving it.

The tests talk to the server with the protocol's real clients (tritonclient, kserve), never
with hand-written requests.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from exported import DEMO_VOCAB_FILES, WORK, demo_artifacts, demo_vocab_config
from server_helpers import ServerThread, repository_args

from tfserve.demo import CHECKPOINT_DIR

TOKEN = "oip-test-token"
# the demo translates English number phrases to French
TEXTS = ["seven", "three hundred and forty-two"]
FRENCH = ["sept", "trois cent quarante-deux"]


@functools.cache
def encoder_artifacts() -> Path:
    """A small random encoder model (decoder_layers 0) with the demo's tokenizer."""
    import torch

    from export.cli import main as export_main
    from tfserve.model import Seq2SeqTransformer, save_checkpoint

    torch.manual_seed(0)
    checkpoint, out = WORK / "oip-encoder-checkpoint", WORK / "oip-encoder"
    save_checkpoint(Seq2SeqTransformer(demo_vocab_config(decoder_layers=0,
                                                         name="tiny-encoder")), checkpoint)
    for name in DEMO_VOCAB_FILES:
        shutil.copy2(CHECKPOINT_DIR / name, checkpoint / name)
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(out), "--quiet",
                        "--parity-samples", "0"]) == 0
    return out


def oip_repository(directory: Path) -> Path:
    """A repository of `demo` (translation) and `encoder` (embeddings)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, artifacts in (("demo", demo_artifacts()), ("encoder", encoder_artifacts())):
        shutil.copytree(artifacts, directory / name)
    return directory


def oip_server(directory: Path, *flags: str) -> ServerThread:
    """A server of `directory` on loopback (gRPC and HTTP), not started."""
    return ServerThread(repository_args(directory, "--max-batch-size", "8", *flags))


@pytest.fixture(scope="module", name="server")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """`server`: a server of the two models for a test module (whose import of this
    function makes it the module's fixture)."""
    with oip_server(oip_repository(tmp_path_factory.mktemp("oip") / "models")) as running:
        yield running


def grpc_url(server: ServerThread) -> str:
    return server.target


def http_url(server: ServerThread) -> str:
    """The HTTP front end's host:port, as tritonclient takes it (no scheme)."""
    return server.http_url.removeprefix("http://")


@contextmanager
def spans_of(server: ServerThread) -> Iterator[Any]:
    """The server's calls traced into an in-memory exporter (which this yields) while the
    block runs; skipped without OpenTelemetry's SDK."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tfserve.serving.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    calls = server.server.core.calls
    calls.tracing = Tracing(provider.get_tracer("tfserve-test"))
    try:
        yield exporter
    finally:
        calls.tracing = None
        provider.shutdown()


def one_span(server: ServerThread, exporter: Any) -> Any:
    """The one span exported (waited for on the server's loop)."""
    server.wait_until(lambda: len(exporter.get_finished_spans()) >= 1)
    (span,) = exporter.get_finished_spans()
    return span
