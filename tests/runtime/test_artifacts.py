"""Start-up with broken artifacts: one clear error naming the file, never a traceback.

Each case copies exported artifacts (the demo, or a small sinusoidal / learned-positions
model) into a temporary directory and breaks one thing: a graph file (empty, random bytes,
truncated), its external data (truncated, empty), a path that leads outside the directory
(in model.json, through a link, or inside the graph file), or a manifest that claims what
its graphs do not take (vocabulary, positions, layers, heads, float type, token ids). Then

- `Runtime(dir)` and `Translator(dir)` raise ValueError naming the file, and for a manifest
  that disagrees with its graphs the field, its value and the graph's figure;
- `python -m tfserve serve --model DIR` exits 2 with that message as its one stderr line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.exported import artifacts, demo_artifacts

ROOT = Path(__file__).resolve().parents[2]


def _edit_manifest(directory: Path, change: Callable[[dict], None]) -> None:
    path = directory / "model.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    change(manifest)
    path.write_text(json.dumps(manifest), encoding="utf-8")


def _set_model(**values: object) -> Callable[[Path], None]:
    return lambda directory: _edit_manifest(directory, lambda m: m["model"].update(values))


def _set(section: str, key: str, value: object) -> Callable[[Path], None]:
    return lambda directory: _edit_manifest(directory, lambda m: m[section].update({key: value}))


def _write(name: str, content: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def breaker(directory: Path) -> None:
        path = directory / name
        path.write_bytes(content(path.read_bytes()))
    return breaker


def _link_outside(name: str) -> Callable[[Path], None]:
    """Replace `name` by a link to an identical file outside the directory."""
    def breaker(directory: Path) -> None:
        outside = directory.parent / f"outside-{name}"
        shutil.copy2(directory / name, outside)
        (directory / name).unlink()
        (directory / name).symlink_to(outside)
    return breaker


def _external_data_outside(directory: Path) -> None:
    """encoder.onnx itself names external data in the parent directory (model.json does not
    name a data file, so only the graph file leads there)."""
    import onnx

    graph_path = directory / "encoder.onnx"
    graph = onnx.load(str(graph_path), load_external_data=False)
    shutil.move(directory / "encoder.onnx.data", directory.parent / "stolen.data")
    for tensor in graph.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../stolen.data"
    onnx.save(graph, str(graph_path))
    _edit_manifest(directory, lambda m: m["graphs"]["encoder"].update(data=""))


def _random_bytes(_: bytes) -> bytes:
    return np.random.default_rng(0).bytes(4096)


# name -> (artifacts, how to break them, what the message says)
CASES: dict[str, tuple[str, Callable[[Path], None], tuple[str, ...]]] = {
    "encoder-empty": ("demo", _write("encoder.onnx", lambda b: b""),
                      ("encoder.onnx: not a loadable ONNX graph", "empty")),
    "encoder-random": ("demo", _write("encoder.onnx", _random_bytes),
                       ("encoder.onnx: not a loadable ONNX graph",)),
    "encoder-truncated": ("demo", _write("encoder.onnx", lambda b: b[: len(b) // 2]),
                          ("encoder.onnx: not a loadable ONNX graph",)),
    "decoder-truncated": ("demo", _write("decoder.onnx", lambda b: b[: len(b) - 100]),
                          ("decoder.onnx: not a loadable ONNX graph",)),
    "encoder-data-truncated": ("demo", _write("encoder.onnx.data", lambda b: b[: len(b) // 2]),
                               ("encoder.onnx: not a loadable ONNX graph",
                                "out of bounds")),
    "decoder-data-empty": ("demo", _write("decoder.onnx.data", lambda b: b""),
                           ("decoder.onnx: not a loadable ONNX graph",)),
    "graph-path-outside": ("demo", lambda d: _edit_manifest(
        d, lambda m: m["graphs"]["encoder"].update(file="../../../etc/passwd")),
        ("model.json names '../../../etc/passwd', which is outside",)),
    "graph-link-outside": ("demo", _link_outside("encoder.onnx"),
                           ("model.json names 'encoder.onnx', which is outside",)),
    "data-link-outside": ("demo", _link_outside("decoder.onnx.data"),
                          ("model.json names 'decoder.onnx.data', which is outside",)),
    "tokenizer-link-outside": ("demo", _link_outside("source.spm"),
                               ("model.json names 'source.spm', which is outside",)),
    "external-data-outside": ("demo", _external_data_outside,
                              ("encoder.onnx names external data '../stolen.data', which "
                               "is outside",)),
    "no-decoder-graph": ("demo", lambda d: _edit_manifest(d, lambda m: m["graphs"].pop("decoder")),
                         ("model.json: graphs.decoder is required unless model.decoder_layers "
                          "is 0 (an encoder-only model)",)),
    "decoder-layers-0": ("demo", _set_model(decoder_layers=0),
                         ("model.json: model.decoder_layers is 0, but encoder.onnx has 3 "
                          "decoder layers (cross_key_*)",)),
    "manifest-truncated": ("demo", _write("model.json", lambda b: b[: len(b) // 2]),
                           ("cannot read", "model.json")),
    "vocab-size": ("demo", _set_model(vocab_size=5),
                   ("model.json: model.vocab_size is 5, but the decoder graph's logits have "
                    "111 entries (decoder.onnx)",)),
    "max-target-positions": ("demo", _set_model(max_target_positions=100000),
                             ("model.json: model.max_target_positions is 100000, but the "
                              "decoder graph cannot take position 99999: decoder.onnx's "
                              "position table", "has 64 rows")),
    "max-source-positions": ("demo", _set_model(max_source_positions=100000),
                             ("model.json: model.max_source_positions is 100000, but the "
                              "encoder graph cannot take 100000 tokens: encoder.onnx's "
                              "position table", "has 64 rows")),
    "sinusoidal-max-target-positions": (
        "sinusoidal", _set_model(max_target_positions=129),
        ("model.max_target_positions is 129, but the decoder graph cannot take position "
         "128: decoder.onnx's position table", "has 128 rows")),
    "learned-max-source-positions": (
        "learned", _set_model(max_source_positions=301),
        ("model.max_source_positions is 301, but the encoder graph cannot take 301 tokens: "
         "encoder.onnx's position table 'model.encoder_embed.position_embedding.weight' "
         "has 300 rows",)),
    "eos": ("demo", _set_model(eos_token_id=999),
            ("model.json: eos_token_id must be an integer in [0, vocab_size=111), got 999",)),
    "decoder-start": ("demo", _set_model(decoder_start_token_id=111),
                      ("model.json: decoder_start_token_id must be an integer in "
                       "[0, vocab_size=111), got 111",)),
    "tokenizer-pad": ("demo", _set("tokenizer", "pad_token_id", 999),
                      ("model.json: tokenizer.pad_token_id is 999, outside the vocabulary "
                       "[0, 111)",)),
    "decoder-layers": ("demo", _set_model(decoder_layers=4),
                       ("model.json: model.decoder_layers is 4, but encoder.onnx has 3 "
                        "decoder layers",)),
    "num-heads": ("demo", _set_model(num_heads=8),
                  ("model.json: model.num_heads is 8, but decoder.onnx's past_key_0 has 4 "
                   "heads",)),
    "dtype": ("demo", lambda d: _edit_manifest(d, lambda m: m.update(dtype="fp16")),
              ("model.json: dtype is fp16, but decoder.onnx's past_key_0 is tensor(float)",)),
}

SOURCES: dict[str, Callable[[], Path]] = {
    "demo": demo_artifacts,
    "sinusoidal": lambda: artifacts("sinusoidal", "pre"),
    "learned": lambda: artifacts("learned", "pre"),
}


@pytest.fixture
def broken(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A broken copy of the case's artifacts, and what its error must say."""
    source, breaker, message = CASES[request.param]
    directory = tmp_path / "artifacts" / "model"
    shutil.copytree(SOURCES[source](), directory)
    breaker(directory)
    return directory, message


@pytest.mark.parametrize("broken", list(CASES), indirect=True)
def test_runtime_and_translator_refuse_naming_the_file(
        broken: tuple[Path, tuple[str, ...]]) -> None:
    from tfserve import Translator
    from tfserve.runtime import Runtime

    directory, message = broken
    for load in (Runtime, Translator):
        with pytest.raises(ValueError) as raised:
            load(directory, intra_op_threads=1)
        text = str(raised.value)
        assert str(directory) in text, text
        for part in message:
            assert part in text, text
        assert "\n" not in text, text


@pytest.mark.parametrize("broken", list(CASES), indirect=True)
def test_serve_exits_2_with_one_line(broken: tuple[Path, tuple[str, ...]]) -> None:
    directory, message = broken
    proc = subprocess.run(
        [sys.executable, "-m", "tfserve", "serve", "--model", str(directory),
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # a log record, no traceback
    record = json.loads(lines[0])
    assert record["msg"].startswith("cannot serve: ") and "exception" not in record, record
    for part in message:
        assert part in record["msg"], record


def test_intact_artifacts_load(tmp_path: Path) -> None:
    """The checks refuse what is broken only: the copies the cases start from load and
    translate, a link inside the directory included."""
    from tfserve.runtime import Runtime

    for name, source in SOURCES.items():
        directory = tmp_path / name
        shutil.copytree(source(), directory)
        inside = directory / "graphs"
        inside.mkdir()
        (directory / "encoder.onnx").rename(inside / "encoder.onnx")
        (directory / "encoder.onnx").symlink_to(Path("graphs") / "encoder.onnx")
        runtime = Runtime(directory, intra_op_threads=1)
        assert runtime.vocab_size == 111
