"""python -m tfserve.bench.documents: runs on the demo, and the document's translation equals
its sentences translated as one batch and joined back in its layout (the bench refuses to
report figures otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.exported import demo_artifacts
from tfserve.bench import documents


def test_the_document_bench_runs_and_its_document_is_its_sentences_joined(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    code = documents.main(["--model", str(demo_artifacts()), "--sentences", "12",
                           "--rounds", "1", "--threads", "1", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    figures = json.loads(out.read_text())
    assert figures["sentences"] == 12
    assert figures["document_vs_sentences"] > 0 and 0 < figures["overhead_share"]


def test_the_number_document_keeps_a_layout() -> None:
    document = documents.number_document(12, seed=3)
    assert "\n\n" in document and "\n- " in document
    assert document == documents.number_document(12, seed=3)
