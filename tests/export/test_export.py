"""`python -m export`: parity of the ONNX graphs with the eager model, manifest, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from export.cli import main as export_main
from tests.exported import WORK, artifacts, checkpoint, demo_artifacts, demo_trained, eager_model
from tfserve.generation import DecodingOptions
from tfserve.generation.batch import generate
from tfserve.model.eager import EagerBackend
from tfserve.runtime import Runtime

FP32_LOGITS_TOLERANCE = 1e-4
VARIANTS = [(p, n) for p in ("sinusoidal", "rope", "learned") for n in ("post", "pre")]
# (batch, source_len, past_len, new_tokens): all different from the trace example (2,5,3,2)
SHAPES = [(1, 1, 0, 1), (3, 17, 0, 1), (8, 256, 5, 1), (4, 9, 64, 4), (5, 33, 12, 3),
          (2, 100, 1, 2)]
MAX_SEEN = {"logits": 0.0}


def assert_close(actual: np.ndarray, expected: torch.Tensor | np.ndarray, atol: float,
                 what: str) -> float:
    expected = expected.numpy() if isinstance(expected, torch.Tensor) else expected
    diff = float(np.abs(np.asarray(actual, np.float32) - expected).max()) if expected.size else 0.0
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol:g}"
    return diff


def padded_sources(vocab: int, batch: int, length: int, rng: np.random.Generator):
    ids = rng.integers(3, vocab, size=(batch, length), dtype=np.int64)
    mask = np.ones_like(ids)
    for row in range(1, batch):  # rows after the first are padded by a random amount
        valid = int(rng.integers(1, length + 1))
        mask[row, valid:] = 0
        ids[row, valid:] = 0
    return ids, mask


@pytest.mark.parametrize("positions,norm", VARIANTS)
def test_step_parity_at_other_shapes(positions: str, norm: str) -> None:
    """Encoder, cross K/V, first step and cached steps, separately, at many shapes."""
    model = eager_model(positions, norm)
    runtime = Runtime(artifacts(positions, norm))
    eager = EagerBackend(model)
    rng = np.random.default_rng(0)
    for batch, src, past_len, new in SHAPES:
        where = f"{positions}/{norm} B={batch} S={src} P={past_len} T={new}"
        ids, mask = padded_sources(111, batch, src, rng)
        hidden_ref, cross_ref = eager.encode(ids, mask)
        hidden, cross = runtime.encode(ids, mask)
        # padded positions hold garbage by design; compare the real tokens
        valid = mask.astype(bool)
        assert_close(hidden[valid], hidden_ref[valid], 1e-4, f"encoder hidden {where}")
        flat_ref = [t.numpy() for kv in cross_ref for t in kv]
        for got, ref in zip(cross, flat_ref):
            assert_close(got.transpose(0, 2, 1, 3)[valid], ref.transpose(0, 2, 1, 3)[valid],
                         1e-4, f"cross K/V {where}")
        # build a past of past_len by running steps, then one call of `new` tokens
        past_ref, past = eager.empty_past(batch), runtime.empty_past(batch)
        filled = 0
        for chunk in ([1] * past_len if past_len < 8 else [past_len]) + [new]:
            tokens = rng.integers(3, 111, size=(batch, chunk), dtype=np.int64)
            if filled == 0:
                tokens[:, 0] = 0  # decoder start
            positions_ids = np.arange(filled, filled + chunk)[None].repeat(batch, 0)
            self_mask = np.ones((batch, filled + chunk), np.int64)
            logits_ref, past_ref = eager.step(tokens, positions_ids, self_mask, mask, past_ref,
                                              cross_ref)[:2]
            logits, past = runtime.step(tokens, positions_ids, self_mask, mask, past, cross)[:2]
            step = "first step" if filled == 0 else f"cached step P={filled} T={chunk}"
            diff = assert_close(logits, logits_ref, FP32_LOGITS_TOLERANCE, f"{step} {where}")
            MAX_SEEN["logits"] = max(MAX_SEEN["logits"], diff)
            for got, ref in zip(past, [t for kv in past_ref for t in kv]):
                assert_close(got, ref, 1e-4, f"present K/V after {step} {where}")
            filled += chunk
    print(f"{positions}/{norm}: max |logits diff| over {len(SHAPES)} shapes "
          f"{MAX_SEEN['logits']:.2e} (running maximum)")


@pytest.mark.parametrize("positions", ["rope", "sinusoidal"])
def test_rows_with_different_histories_match_rows_alone(positions: str) -> None:
    """Holes in self_attention_mask and per-row position_ids: one batch == each row alone."""
    runtime = Runtime(artifacts(positions, "post"))
    rng = np.random.default_rng(1)
    ids, mask = padded_sources(111, 3, 7, rng)
    _, cross = runtime.encode(ids, mask)
    histories = [5, 0, 2]  # row r has decoded histories[r] tokens already
    width = max(histories)
    tokens_per_row = [rng.integers(3, 111, size=h + 1).tolist() for h in histories]
    alone = []
    for row, h in enumerate(histories):
        row_cross = [c[row : row + 1] for c in cross]
        seq = np.array([tokens_per_row[row]], np.int64)
        logits, _ = runtime.step(seq, np.arange(h + 1)[None], np.ones((1, h + 1), np.int64),
                                 mask[row : row + 1], runtime.empty_past(1), row_cross)[:2]
        alone.append(logits[0, -1])
    # together: each row's history first goes into a shared cache, left-padded with holes
    pasts, self_mask = [], np.zeros((3, width), np.int64)
    for row, h in enumerate(histories):
        row_cross = [c[row : row + 1] for c in cross]
        if h:
            _, present = runtime.step(np.array([tokens_per_row[row][:h]]), np.arange(h)[None],
                                      np.ones((1, h), np.int64), mask[row : row + 1],
                                      runtime.empty_past(1), row_cross)[:2]
        else:
            present = runtime.empty_past(1)
        pasts.append(runtime.pad_time(present, width, left=True))
        self_mask[row, width - h :] = 1
    past = runtime.concat_rows(pasts)
    last = np.array([[t[-1]] for t in tokens_per_row], np.int64)
    positions_ids = np.array([[h] for h in histories], np.int64)
    logits, _ = runtime.step(last, positions_ids, np.concatenate(
        [self_mask, np.ones((3, 1), np.int64)], 1), mask, past, cross)[:2]
    for row in range(3):
        assert_close(logits[row, -1], alone[row], 1e-4, f"row {row} ({positions})")


def test_manifest_records_interface_and_parity() -> None:
    out = artifacts("rope", "pre")
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["format_version"] == 1
    assert manifest["graphs"]["decoder"]["inputs"][:4] == [
        "input_ids", "position_ids", "self_attention_mask", "encoder_attention_mask"]
    assert manifest["graphs"]["encoder"]["outputs"][0] == "encoder_hidden_states"
    parity = manifest["parity"]
    assert parity["passed"] is True
    assert parity["max_abs_diff"]["max_logits"] <= FP32_LOGITS_TOLERANCE
    assert set(parity["max_rel_diff"]) == {"first_step_logits", "cached_step_logits",
                                           "cached_multi_token_step_logits", "max_logits"}
    assert parity["tolerance"]["atol"] == parity["tolerance"]["rtol"] == 1e-4
    assert 0 <= parity["tolerance_ratio"] <= 1 and parity["max_abs_logits"] > 0
    assert len(manifest["provenance"]["source_sha256"]) == 64
    assert manifest["special_tokens"] == {"pad": 0, "eos": 1, "unk": 2, "decoder_start": 0}
    import onnx

    graph = onnx.load(str(out / "decoder.onnx"), load_external_data=False).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in graph.input}
    assert dims["past_key_0"] == ["batch", 4, "past_len", 8]
    assert dims["self_attention_mask"] == ["batch", "total_len"]
    ops = {n.op_type for n in graph.node}
    assert "If" not in ops, "one decoder graph for every step, no If-merged variants"
    # RoPE in the graph, from position_ids: one fused rotation of q and of the new k per layer
    rotations = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotations) == 2 * manifest["model"]["decoder_layers"]
    assert {n.input[1] for n in rotations} == {"position_ids"}
    assert not {"Cos", "Sin"} & ops, "the fp32 graph looks the angles up in its tables"


def test_fused_rope_position_past_its_table_is_a_clear_error() -> None:
    """The fp32 graph's RoPE tables end at max(max_source, max_target) positions: a step
    asked for a position past them fails with the position named, it never reads past them."""
    import onnxruntime as ort

    out = artifacts("rope", "pre")
    runtime = Runtime(out)
    cfg = runtime.config
    ids, mask = padded_sources(111, 1, 3, np.random.default_rng(0))
    _, cross = runtime.encode(ids, mask)
    limit = max(cfg.max_source_positions, cfg.max_target_positions)
    one = np.ones((1, 1), np.int64)
    step = runtime.step(one * 5, one * (limit - 1), one, mask, runtime.empty_past(1), cross)
    assert np.isfinite(step.logits).all()
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=f"position_ids value {limit} .* out of range"):
        runtime.step(one * 5, one * limit, one, mask, runtime.empty_past(1), cross)


@pytest.mark.skipif(not demo_trained(), reason="demo checkpoint not trained yet")
def test_greedy_onnx_equals_eager_on_200_demo_inputs() -> None:
    from tfserve.demo import CHECKPOINT_DIR
    from tfserve.model import load_checkpoint

    runtime = Runtime(demo_artifacts())
    eager = EagerBackend(load_checkpoint(CHECKPOINT_DIR))
    texts = (CHECKPOINT_DIR / "samples.txt").read_text().splitlines()[:200]
    assert len(texts) == 200
    options = DecodingOptions(max_new_tokens=40)
    identical = 0
    for start in range(0, 200, 50):
        ids, mask = runtime.tokenizer.pad_batch(
            [runtime.tokenizer.encode(t) for t in texts[start : start + 50]])
        ref = generate(eager, ids, mask, options)
        out = generate(runtime, ids, mask, options)
        for r, o in zip(ref, out):
            identical += r[0].token_ids == o[0].token_ids
            assert abs(r[0].score - o[0].score) < 1e-4
    assert identical == 200


@pytest.mark.skipif(not demo_trained(), reason="demo checkpoint not trained yet")
def test_int8_quality_on_demo() -> None:
    """int8: logits error reported, >= 99% of demo sentences identical to fp32."""
    from tfserve.demo import CHECKPOINT_DIR

    fp32 = Runtime(demo_artifacts())
    int8 = Runtime(demo_artifacts("int8"))
    report = json.loads((demo_artifacts("int8") / "model.json").read_text())["parity"]
    assert report["precision"] == "int8"
    print(f"int8 parity report: max logits diff {report['max_abs_diff']['max_logits']:.4f}")
    texts = (CHECKPOINT_DIR / "samples.txt").read_text().splitlines()[:200]
    options = DecodingOptions(max_new_tokens=40)
    ids, mask = fp32.tokenizer.pad_batch([fp32.tokenizer.encode(t) for t in texts])
    ref = generate(fp32, ids, mask, options)
    out = generate(int8, ids, mask, options)
    identical = sum(r[0].token_ids == o[0].token_ids for r, o in zip(ref, out))
    print(f"int8 sentences identical to fp32: {identical}/{len(texts)}")
    assert identical / len(texts) >= 0.99


def test_fp16_export_parity_on_cpu() -> None:
    """fp16 graphs (meant for CUDA) also run on ONNX Runtime CPU: check them there."""
    out = WORK / "fp16"
    assert export_main(["--checkpoint", str(checkpoint()), "--out", str(out), "--dtype",
                        "fp16", "--quiet", "--force", "--parity-samples", "0"]) == 0
    manifest = json.loads((out / "model.json").read_text())
    report = manifest["parity"]
    assert report["precision"] == "fp16" and report["passed"]
    print(f"fp16 max logits diff (ORT CPU vs eager fp32): {report['max_abs_diff']['max_logits']}")
    # fused attention always; the check ran where this ONNX Runtime runs it in fp16
    import onnx

    from export.graphs import fp16_parity_device

    assert manifest["provenance"]["attention"] == "fused"
    assert manifest["provenance"]["parity_device"] == report["device"] == fp16_parity_device()
    ops = {node.op_type for node in onnx.load(str(out / "decoder.onnx"),
                                              load_external_data=False).graph.node}
    assert "MultiHeadAttention" in ops and "Softmax" not in ops
    assert report["max_abs_diff"]["max_logits"] < 5e-2
    fp16 = Runtime(out)
    assert fp16.empty_past(1)[0].dtype == np.float16
    ids, mask = padded_sources(111, 4, 12, np.random.default_rng(0))
    ref = generate(EagerBackend(eager_model()), ids, mask, DecodingOptions(max_new_tokens=16))
    got = generate(fp16, ids, mask, DecodingOptions(max_new_tokens=16))
    assert sum(r[0].token_ids == g[0].token_ids for r, g in zip(ref, got)) >= 3


@pytest.mark.gpu
def test_fp16_parity_on_cuda() -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    out = WORK / "fp16-cuda"
    assert export_main(["--checkpoint", str(checkpoint()), "--out", str(out), "--dtype",
                        "fp16", "--quiet", "--force", "--parity-samples", "0"]) == 0
    manifest = json.loads((out / "model.json").read_text())
    # a CUDA device is there: the parity check ran on it
    assert manifest["provenance"]["parity_device"] == manifest["parity"]["device"] == "cuda"
    assert manifest["parity"]["passed"]
    fp16 = Runtime(out, device="cuda")
    ids, mask = padded_sources(111, 4, 12, np.random.default_rng(0))
    ref = generate(EagerBackend(eager_model()), ids, mask, DecodingOptions(max_new_tokens=16))
    got = generate(fp16, ids, mask, DecodingOptions(max_new_tokens=16))
    assert sum(r[0].token_ids == g[0].token_ids for r, g in zip(ref, got)) >= 3


# -- bad input: exit code 2, one line on stderr, nothing written ------------------------------


def run_export(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "export", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def assert_usage_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got: {result.stderr!r}"
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_checkpoint(tmp_path: Path) -> None:
    result = run_export("--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert_usage_error(result, "nope")
    assert not (tmp_path / "o").exists()


def test_corrupt_checkpoint(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint(), broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    result = run_export("--checkpoint", str(broken), "--out", str(tmp_path / "o"))
    assert_usage_error(result, "model.safetensors")
    assert not (tmp_path / "o").exists()


def test_unknown_dtype(tmp_path: Path) -> None:
    assert_usage_error(run_export("--dtype", "bf16", "--out", str(tmp_path / "o")), "--dtype")


def test_out_exists_without_force(tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    result = run_export("--checkpoint", str(checkpoint()), "--out", str(tmp_path / "o"))
    assert_usage_error(result, "already exists", "--force")
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"


@pytest.fixture
def unwritable_directory(tmp_path: Path) -> Iterator[Path]:
    """An existing directory the test's user (and so the export it starts) cannot write in.
    For a user, a directory without write permission; root writes through permissions, so
    for root a read-only bind mount of one (a read-only filesystem refuses root too)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() != 0:
        locked.chmod(0o500)
        yield locked
        locked.chmod(0o700)
        return
    bind = subprocess.run(["mount", "--bind", str(locked), str(locked)], capture_output=True,
                          text=True)
    if bind.returncode != 0:
        pytest.skip(f"running as root and cannot bind-mount: {bind.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(locked)], check=True,
                       capture_output=True)
        yield locked
    finally:
        subprocess.run(["umount", str(locked)], check=True)


def test_unwritable_out(unwritable_directory: Path) -> None:
    assert not os.access(unwritable_directory, os.W_OK)  # what the test is about
    out = unwritable_directory / "o"
    result = run_export("--checkpoint", str(checkpoint()), "--out", str(out))
    assert_usage_error(result, f"directory {unwritable_directory} is not writable")
    assert not out.exists()


def test_unwritable_out_as_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    result = run_export("--checkpoint", str(checkpoint()), "--out",
                        str(tmp_path / "afile" / "o"))
    assert_usage_error(result, "--out")


def test_parity_failure_refuses_and_force_publishes(tmp_path: Path, monkeypatch) -> None:
    import export.verify as verify

    monkeypatch.setitem(verify.TOLERANCES, "fp32", verify.Tolerance(atol=0.0, rtol=0.0))
    out = tmp_path / "o"
    assert export_main(["--checkpoint", str(checkpoint()), "--out", str(out), "--quiet",
                        "--parity-samples", "0"]) == 1
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging left behind"
    assert export_main(["--checkpoint", str(checkpoint()), "--out", str(out), "--quiet",
                        "--parity-samples", "0", "--force"]) == 0
    report = json.loads((out / "model.json").read_text())["parity"]
    assert report["passed"] is False and report["failures"]
    assert report["tolerance_ratio"] > 1e30  # anything but equality, and finite JSON


def test_the_summary_line_reports_the_parity(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Without --quiet, the last line gives the logits' difference, its share of the
    tolerance and the greedy agreement."""
    from tfserve.demo import CHECKPOINT_DIR  # a checkpoint with sample sentences

    out = tmp_path / "o"
    assert export_main(["--checkpoint", str(CHECKPOINT_DIR), "--out", str(out),
                        "--parity-samples", "8"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads((out / "model.json").read_text())["parity"]
    assert last == (f"exported {out}: parity passed: max |logits diff| "
                    f"{report['max_abs_diff']['max_logits']:.2e} (relative "
                    f"{report['max_rel_diff']['max_logits']:.2e}, "
                    f"{report['tolerance_ratio']:.2g} of the tolerance), greedy identical "
                    f"{report['greedy']['identical']}/{report['greedy']['sentences']}")
    assert report["greedy"]["sentences"] == 8


def test_tolerance_scales_with_each_rows_logits() -> None:
    """|diff| <= atol + rtol * (largest |logit| of the row): a row of large logits allows a
    larger difference, on its small logits too; a row of small logits keeps atol."""
    from export.verify import Tolerance, relative_diff

    tolerance = Tolerance(atol=1e-4, rtol=1e-4)
    ref = np.array([[[20.0, 0.0, -3.0], [0.5, 0.0, -0.25]]], np.float32)  # [B=1,T=2,V=3]
    # row 0 allows 1e-4 + 1e-4 * 20 = 2.1e-3 everywhere, row 1 allows 1.5e-4
    got = ref + np.array([[[0.0, 1.05e-3, 0.0], [0.0, 0.0, 0.0]]], np.float32)
    assert tolerance.ratio(got, ref) == pytest.approx(0.5, rel=1e-3)
    assert relative_diff(got, ref) == pytest.approx(1.05e-3 / 20, rel=1e-3)
    got = ref + np.array([[[0.0, 0.0, 0.0], [0.0, 3e-4, 0.0]]], np.float32)
    assert tolerance.ratio(got, ref) == pytest.approx(2.0, rel=1e-3)
    assert relative_diff(got, ref) == pytest.approx(3e-4 / 0.5, rel=1e-3)
    assert tolerance.ratio(ref, ref) == 0.0
    assert Tolerance(0.0, 0.0).ratio(ref, ref) == 0.0
    assert 1e30 < Tolerance(0.0, 0.0).ratio(got, ref) < float("inf")


def test_interrupted_export_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    import export.graphs as graphs

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(graphs, "quantize_int8", boom)
    out = tmp_path / "o"
    assert export_main(["--checkpoint", str(checkpoint()), "--out", str(out), "--quiet",
                        "--quantize", "int8"]) == 130
    assert list(tmp_path.iterdir()) == []


def test_help_documents_every_option() -> None:
    result = run_export("--help")
    assert result.returncode == 0
    for option in ("--checkpoint", "--from-hf", "--out", "--opset", "--force", "--dtype",
                   "--quantize"):
        assert option in result.stdout
