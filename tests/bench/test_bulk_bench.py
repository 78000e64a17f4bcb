"""The bulk benchmark's own runs (python -m tfserve.bench.bulk, tiny model and files): every
engine times the same corpus and writes the in-memory path's translations, the RSS run
measures each size, and the Ray run translates with 1 and 2 actors into the one-machine
job's output. Slow: each engine is a child process that loads its model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tfserve.bench import bulk

pytestmark = pytest.mark.slow


def test_quick_throughput_runs_every_engine_on_the_same_translations(tmp_path: Path) -> None:
    for module in ("torch", "onnx", "transformers", "ctranslate2", "sentencepiece"):
        pytest.importorskip(module)
    results = tmp_path / "bulk.json"
    assert bulk.main(["--quick", "--work", str(tmp_path / "work"), "--lines", "120",
                      "--json", str(results)]) == 0
    data = json.loads(results.read_text())
    assert set(data["engines"]) == set(bulk.ENGINES)
    for row in data["engines"].values():
        assert row["lines"] > 100 and row["tok_s"] > 0
    assert set(data["ratios"]) == {"file_over_memory", "file_over_ct2", "server_over_file"}
    # the same batches as the in-memory path: the same lines; the server's batches mix
    # requests, and padding may move a near tie
    assert data["lines_as_memory"]["file"] == 1.0
    assert data["lines_as_memory"]["server"] >= 0.9


def test_quick_rss_measures_each_size(tmp_path: Path) -> None:
    results = tmp_path / "rss.json"
    assert bulk.main(["--quick", "--rss", "--rss-lines", "200,2000", "--work",
                      str(tmp_path / "work"), "--json", str(results)]) == 0
    data = json.loads(results.read_text())
    assert [row["lines"] for row in data["rss"]] == [200, 2000]
    assert all(row["peak_rss_mib"] > 0 for row in data["rss"])
    assert data["rss_ratio"] == pytest.approx(data["rss"][1]["peak_rss_mib"]
                                              / data["rss"][0]["peak_rss_mib"], abs=1e-3)


def test_quick_ray_scaling_writes_the_one_machine_output(tmp_path: Path) -> None:
    for module in ("torch", "onnx", "transformers", "ray.data"):
        pytest.importorskip(module)
    results = tmp_path / "ray.json"
    assert bulk.main(["--quick", "--ray-scaling", "--lines", "60", "--threads", "2",
                      "--work", str(tmp_path / "work"), "--json", str(results)]) == 0
    data = json.loads(results.read_text())
    assert set(data["runs"]) == {"file-1", "file-2", "ray-1", "ray-2"}
    assert data["outputs_equal"] is True
    assert data["ray_scaling"] > 0 and data["ray_over_file"] > 0
