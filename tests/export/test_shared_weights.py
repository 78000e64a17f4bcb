"""A tied embedding is stored once and held once in memory.

The model: a small random one with tied embeddings (one table for the encoder's tokens, the
decoder's tokens and the output projection) and a vocabulary large enough for the table to
be shared (export.graphs.SHARED_MIN_BYTES) and to be measured. Exported as `python -m export`
writes it now, and as it wrote it before (each graph its own copy, the decoder's projection
a transposed copy: `tie_output_projection` and `share_tensors` switched off), which must
still load. Checked:

- the artifacts hold the table's bytes once (counted over every initializer of both graphs,
  by the file and offset they name), the decoder's projection reads it (FusedMatMul with
  transB), and after ONNX Runtime's optimizations the decoder still holds one copy;
- `Runtime` hands one OrtValue over those bytes to both sessions; in a child process, the
  file is mapped once and the old layout's extra copy (the projection's pre-packed weight)
  is gone from the anonymous memory;
- greedy and beam tokens are those of the old layout; int8 and fp16 exports still pass
  their parity checks (int8: the quantized encoder and decoder tables stored once).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from export.cli import main as export_main
from tests.exported import DEMO_VOCAB_FILES, WORK, demo_vocab_config
from tfserve.demo import CHECKPOINT_DIR
from tfserve.generation import DecodingOptions
from tfserve.generation.batch import generate
from tfserve.model import Seq2SeqTransformer, save_checkpoint
from tfserve.runtime import Runtime

ROOT = Path(__file__).resolve().parents[2]
VOCAB, D_MODEL = 16000, 128  # the table: 16,000 x 128 fp32 = 8.2 MB
TABLE_BYTES = VOCAB * D_MODEL * 4
SHARED = "shared_weights.data"


@functools.cache
def checkpoint() -> Path:
    """A random sinusoidal post-norm model with tied embeddings, the demo's tokenizer."""
    torch.manual_seed(0)
    config = demo_vocab_config("sinusoidal", "post", vocab_size=VOCAB, d_model=D_MODEL,
                               num_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=128,
                         name="tiny-tied")
    assert config.tie_word_embeddings
    directory = WORK / "ckpt-tied"
    save_checkpoint(Seq2SeqTransformer(config), directory)
    for name in DEMO_VOCAB_FILES:
        shutil.copy2(CHECKPOINT_DIR / name, directory / name)
    return directory


@contextmanager
def old_layout() -> Iterator[None]:
    """Exports as before shared weights: no tied projection, nothing shared."""
    import export.graphs as graphs

    tie, share = graphs.tie_output_projection, graphs.share_tensors
    graphs.tie_output_projection = lambda model: False
    graphs.share_tensors = lambda models, path: False
    try:
        yield
    finally:
        graphs.tie_output_projection, graphs.share_tensors = tie, share


def exported(layout: str = "shared", *extra: str) -> Path:
    """checkpoint() exported (layout "shared" or "old"; extra: export flags), once."""
    return _exported(layout, extra)  # one cache key however the arguments were spelled


@functools.cache
def _exported(layout: str, extra: tuple[str, ...]) -> Path:
    out = WORK / f"tied-{layout}{''.join(extra).replace('-', '')}"
    args = ["--checkpoint", str(checkpoint()), "--out", str(out), "--quiet",
            "--parity-samples", "0", *extra]
    if layout == "old":
        with old_layout():
            assert export_main(args) == 0
    else:
        assert export_main(args) == 0
    return out


def stored_tables(directory: Path, element_bytes: int = 4) -> dict[tuple, list[str]]:
    """Where each initializer of the table's size ([V,D] or [D,V]) is stored, over both
    graphs: (file, offset, length) or (graph, name) for one inside its graph -> the
    initializer names that read those bytes."""
    import onnx

    places: dict[tuple, list[str]] = {}
    for graph in ("encoder.onnx", "decoder.onnx"):
        model = onnx.load(str(directory / graph), load_external_data=False)
        for tensor in model.graph.initializer:
            if sorted(tensor.dims) != sorted([VOCAB, D_MODEL]):
                continue
            entries = {entry.key: entry.value for entry in tensor.external_data}
            place = ((entries["location"], int(entries.get("offset", 0)),
                      int(entries["length"])) if entries else (graph, tensor.name))
            places.setdefault(place, []).append(f"{graph}:{tensor.name}")
    assert all(place[2] == VOCAB * D_MODEL * element_bytes for place in places
               if len(place) == 3)
    return places


def data_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir()
               if path.name.endswith(".data"))


def test_the_table_is_stored_once() -> None:
    new, old = exported("shared"), exported("old")
    places = stored_tables(new)
    assert list(places) == [(SHARED, 0, TABLE_BYTES)], places
    assert sorted(places[(SHARED, 0, TABLE_BYTES)]) == [
        "decoder.onnx:model.shared.weight", "encoder.onnx:model.shared.weight"]
    assert (new / SHARED).stat().st_size == TABLE_BYTES
    # before: the encoder's table, the decoder's table and its transposed projection
    assert len(stored_tables(old)) == 3 and not (old / SHARED).exists()
    assert data_bytes(old) - data_bytes(new) == 2 * TABLE_BYTES


def test_the_projection_reads_the_table_after_optimization(tmp_path: Path) -> None:
    import onnx
    import onnxruntime as ort

    graph = onnx.load(str(exported() / "decoder.onnx"), load_external_data=False).graph
    projection = [node for node in graph.node if node.op_type == "FusedMatMul"]
    assert len(projection) == 1 and projection[0].input[1] == "model.shared.weight"
    assert {(a.name, a.i) for a in projection[0].attribute} >= {("transB", 1)}
    assert not [node for node in graph.node if node.op_type == "MatMul"
                and node.output[0] == projection[0].output[0]]
    # an initializer listed among the inputs is not constant to ONNX Runtime: not folded,
    # not pre-packed; the interface's inputs (get_inputs) do not list it
    assert "model.shared.weight" in {value.name for value in graph.input}

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", "optimized.data")
    session = ort.InferenceSession(str(exported() / "decoder.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    assert "model.shared.weight" not in {value.name for value in session.get_inputs()}
    optimized = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph
    tables = [t.name for t in optimized.initializer
              if sorted(t.dims) == sorted([VOCAB, D_MODEL])]
    assert tables == ["model.shared.weight"]
    readers = sorted(node.op_type for node in optimized.node
                     if "model.shared.weight" in node.input)
    assert readers == ["FusedMatMul", "Gather"]


def test_the_runtime_gives_one_buffer_to_both_sessions(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    import tfserve.runtime.sessions as backend

    given: dict[str, dict] = {}
    make_session = backend.make_session

    def recording(path, **kwargs):  # noqa: ANN001, ANN202 - make_session's own signature
        given[Path(path).name] = dict(kwargs.get("initializers") or {})
        return make_session(path, **kwargs)

    monkeypatch.setattr(backend, "make_session", recording)
    runtime = Runtime(exported())
    encoder, decoder = given["encoder.onnx"], given["decoder.onnx"]
    assert list(encoder) == list(decoder) == ["model.shared.weight"]
    value = encoder["model.shared.weight"]
    assert decoder["model.shared.weight"] is value
    assert runtime.shared_weights["decoder"]["model.shared.weight"] is value
    assert value.shape() == [VOCAB, D_MODEL]
    table = np.fromfile(exported() / SHARED, np.float32).reshape(VOCAB, D_MODEL)
    assert np.array_equal(value.numpy(), table)

    # artifacts made before (each graph its own copy) load and share nothing
    given.clear()
    old = Runtime(exported("old"))
    assert old.shared_weights == {"encoder": {}, "decoder": {}}
    # nothing to pre-pack there (no tied table): ModelInfo's packed_weights says so
    assert old.pack_weights and not old.describe()["pack_weights"]
    assert given == {"encoder.onnx": {}, "decoder.onnx": {}}


MEMORY_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from tfserve.generation.batch import generate
    from tfserve.generation import DecodingOptions
    from tfserve.runtime import Runtime

    def anonymous():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    directory, pack = sys.argv[1], sys.argv[2] == "packed"
    before = anonymous()
    runtime = Runtime(directory, intra_op_threads=1, pack_weights=pack)
    ids = np.full((4, 10), 5, np.int64)
    ids[:, -1] = runtime.eos_token_id
    generate(runtime, ids, np.ones_like(ids), DecodingOptions(max_new_tokens=4,
                                                              min_new_tokens=4))
    grown = anonymous() - before
    mapped, current = {}, None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            current = fields[5] if len(fields) > 5 and directory in fields[5] else None
            if current:
                mapped.setdefault(current.rsplit("/", 1)[-1], []).append(0)
        elif fields[0] == "Rss:" and current:
            mapped[current.rsplit("/", 1)[-1]][-1] = int(fields[1]) * 1024
    print(json.dumps({"anonymous_growth": grown, "mapped": mapped}))
""")


def memory_after_load(directory: Path, packing: str = "shared") -> dict:
    """In a child process (no torch): the anonymous memory grown over load and a short
    generation, and the resident bytes of each mapping of the artifacts' files; packing
    "packed": the runtime pre-packs the tied projection's weight (Runtime(pack_weights))."""
    import json

    # the child reads the files as a server starting on them does, from the disk: the page
    # cache that writing them left (large folios, which a read maps whole) is not its own
    for file in directory.iterdir():
        with file.open("rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(directory), packing],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux /proc")
def test_the_process_holds_one_copy() -> None:
    new, old = memory_after_load(exported()), memory_after_load(exported("old"))
    # one mapping of the shared file, whose pages the projection reads: the table once
    assert len(new["mapped"][SHARED]) == 1, new
    assert new["mapped"][SHARED][0] <= TABLE_BYTES
    assert new["mapped"][SHARED][0] >= TABLE_BYTES // 2  # every row scored each step
    # the old layout also held the projection's pre-packed copy (anonymous memory)
    assert old["anonymous_growth"] - new["anonymous_growth"] >= 0.75 * TABLE_BYTES, (old, new)
    # pre-packed on request (CPU's default, for speed): the packed copy in anonymous memory,
    # and of the mapped table only the pages of the rows looked up (the projection reads
    # the packed copy; the pages packing read left the process)
    packed = memory_after_load(exported(), "packed")
    more = packed["anonymous_growth"] - new["anonymous_growth"]
    assert 0.75 * TABLE_BYTES <= more <= 1.5 * TABLE_BYTES, (packed, new)
    assert sum(packed["mapped"][SHARED]) <= TABLE_BYTES // 8, packed


def assert_same(got: list, want: list, label: str) -> None:
    """The same hypotheses per source: tokens equal, scores within 1e-4."""
    assert [[h.token_ids for h in r] for r in got] == \
           [[h.token_ids for h in r] for r in want], label
    for r_got, r_want in zip(got, want):
        for h_got, h_want in zip(r_got, r_want):
            assert abs(h_got.score - h_want.score) <= 1e-4, label


def test_tokens_are_those_of_the_old_layout() -> None:
    new, old = Runtime(exported()), Runtime(exported("old"))
    rng = np.random.default_rng(3)
    sources = [rng.integers(3, 111, size=n).tolist() + [1] for n in (4, 9, 6, 12)]
    ids, mask = new.tokenizer.pad_batch(sources)
    for beams in (1, 4):
        options = DecodingOptions(max_new_tokens=12, num_beams=beams)
        assert_same(generate(new, ids, mask, options), generate(old, ids, mask, options),
                    f"beams {beams}")


def test_fp16_and_int8_exports_pass_parity() -> None:
    import json

    import onnx

    fp16 = exported("shared", "--dtype", "fp16")
    assert json.loads((fp16 / "model.json").read_text())["parity"]["passed"]
    decoder = onnx.load(str(fp16 / "decoder.onnx"), load_external_data=False).graph
    assert [node.input[1] for node in decoder.node if node.op_type == "FusedMatMul"] == [
        "model.shared.weight"]
    assert list(stored_tables(fp16, element_bytes=2)) == [(SHARED, 0, TABLE_BYTES // 2)]

    int8 = exported("shared", "--quantize", "int8")
    assert json.loads((int8 / "model.json").read_text())["parity"]["passed"]
    # the quantized table (int8 [V,D]) once for both graphs; the int8 projection [D,V]
    # is the decoder's own (ONNX Runtime's int8 MatMuls take no transposed weight)
    places = stored_tables(int8, element_bytes=1)
    shared = [place for place in places if place[0] == SHARED]
    assert len(shared) == 1 and len(places[shared[0]]) == 2, places
    assert (int8 / SHARED).stat().st_size == VOCAB * D_MODEL
    Runtime(int8)  # loads, runs one step


def test_cpu_pre_packs_the_tied_projection_by_default() -> None:
    """On CPU the runtime makes the tied table a constant of its decoder session, so ONNX
    Runtime pre-packs it for the projection (`pack_weights`, default on CPU); asked not to,
    the table stays an overridable input, one copy. The tokens and scores are the same."""
    from tfserve.runtime.packed_weights import constant_weights

    packed, shared = Runtime(exported()), Runtime(exported(), pack_weights=False)
    assert packed.pack_weights and packed.describe()["pack_weights"]
    assert not shared.pack_weights
    assert [v.name for v in shared.decoder.get_overridable_initializers()] == [
        "model.shared.weight"]
    assert packed.decoder.get_overridable_initializers() == []
    rng = np.random.default_rng(5)
    sources = [rng.integers(3, 111, size=n).tolist() + [1] for n in (3, 8, 5)]
    ids, mask = packed.tokenizer.pad_batch(sources)
    for beams in (1, 3):
        options = DecodingOptions(max_new_tokens=10, num_beams=beams)
        assert_same(generate(packed, ids, mask, options),
                    generate(shared, ids, mask, options), f"beams {beams}")
    # a graph without such inputs (the encoder) is left as it is
    encoder = (exported() / "encoder.onnx").read_bytes()
    assert constant_weights(encoder) == (encoder, [])
