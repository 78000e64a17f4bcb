"""Weights that several graphs of one artifacts directory share, loaded once.

`python -m export` stores a tensor that the encoder and the decoder both hold (the shared
token embedding, equal position tables) once, in one external data file that both graph
files name at the same offset (`export.graphs.store_weights_externally`). Each ONNX Runtime
session would map those bytes for itself: two mappings of one file, which count twice in
the process's resident memory wherever both sessions touch them. Here the bytes are mapped
once (a read-only file mapping: file-backed pages, loaded as they are read) and the one
OrtValue over them is handed to every session that names them
(`SessionOptions.add_initializer`), so the process holds one copy.

Where ONNX Runtime pre-packs the tied table for the output projection (the CPU default,
`tfserve.runtime.packed_weights`), packing reads every page of the mapping, and the packed
copy is what the projection reads from then on; the mapping is only read by the embedding
lookups, a row per token. `SharedInitializers.drop_resident_pages` then lets the pages go
from the process (`madvise(MADV_DONTNEED)` on the read-only file mapping: the file stays in
the page cache, a row read later faults back in), so the process holds the packed copy and
the rows it looks up, not the table twice. While the session packs, `dropping_pages` does
the same every few milliseconds from a thread of its own (ONNX Runtime releases the GIL while
it builds a session), so the pages packing has read leave as it goes and the load's peak is
the packed copy and a few milliseconds' worth of pages, not the table twice. Dropping a page
never changes what is read: only where from.

Older exports, where each graph holds its own copy, share nothing and load as before.
Reading the graph files takes the minimal protobuf reader of `tfserve.artifacts.manifest` (the
serving
path has no `onnx` package, and ONNX Runtime does not show where an initializer is stored).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tfserve.artifacts.manifest import (
    _GRAPH_INITIALIZER,
    _LENGTH,
    _MODEL_GRAPH,
    _fields,
    _tensor_fields,
)

# TensorProto.DataType -> numpy: the element types an export stores
NUMPY_TYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64,
               10: np.float16, 11: np.float64}
ALIGNMENT = 64  # an offset the kernels' vector loads can take as a tensor's start
# how often `dropping_pages` lets the pages read so far go: packing reads a few MB in that
# time, and a madvise over pages no longer present costs microseconds
DROP_PERIOD_S = 0.002


@dataclass(frozen=True)
class ExternalTensor:
    """An initializer whose bytes lie in an external data file."""

    name: str
    location: str  # the file, relative to the graph's directory
    offset: int
    length: int
    data_type: int  # TensorProto.DataType
    dims: tuple[int, ...]

    @property
    def place(self) -> tuple[str, int, int]:
        """Where its bytes are: (location, offset, length)."""
        return self.location, self.offset, self.length


def external_tensors(path: Path) -> list[ExternalTensor]:
    """The initializers of the ONNX file `path` stored in external data files (ValueError or
    OSError when it cannot be read: the caller's graph checks report those)."""
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0,
                                              access=mmap.ACCESS_READ) as data:
        found = []
        for number, wire, start, end in _fields(data, 0, len(data)):
            if number != _MODEL_GRAPH or wire != _LENGTH:
                continue
            for field, kind, a, b in _fields(data, start, end):
                if field == _GRAPH_INITIALIZER and kind == _LENGTH:
                    tensor = _external_tensor(data, a, b)
                    if tensor is not None:
                        found.append(tensor)
        return found


def _external_tensor(data: mmap.mmap, start: int, end: int) -> ExternalTensor | None:
    name, data_type, dims, external = _tensor_fields(data, start, end)
    entries = dict(external)
    if not name or "location" not in entries:
        return None
    try:
        offset, length = int(entries.get("offset", "0")), int(entries["length"])
    except (KeyError, ValueError):
        return None  # no length: ONNX Runtime reads to the end of the file itself
    return ExternalTensor(name, entries["location"], offset, length, data_type, tuple(dims))


@dataclass
class SharedInitializers:
    """What `shared_initializers` maps: per graph file, name -> OrtValue (the same OrtValue
    for every graph naming the same bytes), and the file mappings under them."""

    per_graph: list[dict[str, ort.OrtValue]]
    mappings: list[mmap.mmap] = field(default_factory=list)

    def drop_resident_pages(self) -> None:
        """Let the pages read so far go from the process's resident memory (they are read
        again from the file, through the page cache, when next touched)."""
        self._advise(getattr(mmap, "MADV_DONTNEED", None))

    def read_in_rows(self) -> None:
        """From now on the mappings are read a row at a time: no read-ahead around a lookup,
        and no huge page of the file mapped for one row."""
        self._advise(getattr(mmap, "MADV_NOHUGEPAGE", None))
        self._advise(getattr(mmap, "MADV_RANDOM", None))

    def _advise(self, advice: int | None) -> None:
        if advice is None:  # a platform without this advice
            return
        for mapping in self.mappings:
            if hasattr(mapping, "madvise"):  # not on Windows
                mapping.madvise(advice)

    @contextmanager
    def dropping_pages(self, period_s: float = DROP_PERIOD_S) -> Iterator[None]:
        """drop_resident_pages every `period_s` seconds while the block runs (a session
        being built packs the tables), and once more at its end; then read_in_rows."""
        if not self.mappings:
            yield
            return
        self._advise(getattr(mmap, "MADV_SEQUENTIAL", None))  # packing reads them through
        done = threading.Event()

        def drop() -> None:
            while not done.wait(period_s):
                self.drop_resident_pages()

        dropper = threading.Thread(target=drop, name="tfserve-drop-pages", daemon=True)
        dropper.start()
        try:
            yield
        finally:
            done.set()
            dropper.join()
            self.drop_resident_pages()
            self.read_in_rows()


def shared_initializers(graphs: Sequence[Path]) -> SharedInitializers:
    """For each graph file, the OrtValues of its initializers that another of `graphs` names
    at the same bytes (name -> value; the same OrtValue object for every graph naming them).

    Bytes are shared only where they make a tensor as the graphs declare it: a known element
    type, a length of dims x element size, inside the file, at an aligned offset; anything
    else is left to ONNX Runtime, which loads it (or reports it) as it always does.
    """
    declared = [external_tensors(path) for path in graphs]
    holders: dict[tuple[Path, int, int], set[int]] = {}
    for number, (path, tensors) in enumerate(zip(graphs, declared)):
        for tensor in tensors:
            holders.setdefault(_key(path, tensor), set()).add(number)
    values: dict[tuple[Path, int, int], tuple[ort.OrtValue, mmap.mmap] | None] = {}
    shared = SharedInitializers([{} for _ in graphs])
    for number, (path, tensors) in enumerate(zip(graphs, declared)):
        for tensor in tensors:
            key = _key(path, tensor)
            if len(holders[key]) < 2:
                continue
            if key not in values:
                values[key] = mapped = _mapped(key[0], tensor)
                if mapped is not None:
                    shared.mappings.append(mapped[1])
            value = values[key]
            if value is not None:
                shared.per_graph[number][tensor.name] = value[0]
    return shared


def _key(graph: Path, tensor: ExternalTensor) -> tuple[Path, int, int]:
    """The bytes a tensor names: its file (links resolved), offset and length."""
    return (graph.parent / tensor.location).resolve(), tensor.offset, tensor.length


def _mapped(file: Path, tensor: ExternalTensor) -> tuple[ort.OrtValue, mmap.mmap] | None:
    """An OrtValue over the tensor's bytes in `file`, mapped read-only, and the mapping (None
    when they do not make the tensor the graph declares)."""
    dtype = NUMPY_TYPES.get(tensor.data_type)
    if dtype is None or tensor.offset % ALIGNMENT:
        return None
    count = int(np.prod(tensor.dims, dtype=np.int64))
    if count * np.dtype(dtype).itemsize != tensor.length:
        return None
    try:
        if tensor.offset + tensor.length > file.stat().st_size:
            return None
        # a mapping starts at a multiple of the allocation granularity
        start = tensor.offset - tensor.offset % mmap.ALLOCATIONGRANULARITY
        with file.open("rb") as handle:
            mapping = mmap.mmap(handle.fileno(), tensor.offset + tensor.length - start,
                                access=mmap.ACCESS_READ, offset=start)
        array = np.frombuffer(mapping, dtype, count, tensor.offset - start)
    except (OSError, ValueError):
        return None
    # the OrtValue keeps the array, and the array the mapping, alive; it reads the pages
    # where they are (no copy)
    return ort.OrtValue.ortvalue_from_numpy(array.reshape(tensor.dims)), mapping

