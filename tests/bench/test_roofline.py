"""tfserve.bench.roofline: the bytes a batch-1 decoder step reads, and the share of the
bandwidth roofline a decode rate reaches."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("onnx")

from exported import demo_artifacts  # noqa: E402

from tfserve.bench import roofline  # noqa: E402


def test_a_step_reads_every_decoder_weight_and_its_rows_caches() -> None:
    artifacts = demo_artifacts()
    model = json.loads((artifacts / "model.json").read_text())["model"]
    step = roofline.bytes_per_step(artifacts, source_tokens=25, mean_position=16)
    # the demo's decoder keeps its weights in decoder.onnx.data; a small initializer or two
    # (shapes, constants folded into initializers) live in the graph file itself
    external = (artifacts / "decoder.onnx.data").stat().st_size
    assert external <= step["weights"] <= external + (artifacts / "decoder.onnx").stat().st_size
    head_dim = model["d_model"] // model["num_heads"]
    per_position = model["decoder_layers"] * 2 * model["num_heads"] * head_dim * 4  # K and V
    assert step["cache"] == per_position * (25 + 16)


def test_the_share_is_bytes_per_second_over_bandwidth() -> None:
    # 500 MB a step at 20 tokens/s against 20 GB/s is half the roofline
    assert roofline.roofline_share(500_000_000, 20.0, 20e9) == pytest.approx(0.5)
    shares = roofline.batch_one_shares(demo_artifacts(), {"tfserve-fp32": 100.0}, 25, 32,
                                       threads=1)
    assert shares["read_bandwidth_gb_s"] > 0
    assert shares["share"]["tfserve-fp32"] == pytest.approx(
        shares["bytes_per_step"] * 100.0 / (shares["read_bandwidth_gb_s"] * 1e9), rel=0.001)


def test_the_command_refuses_a_directory_without_a_decoder(tmp_path, capsys) -> None:
    assert roofline.main([str(tmp_path), "--tokens-per-second", "10"]) == 2
    assert "no decoder.onnx" in capsys.readouterr().err
