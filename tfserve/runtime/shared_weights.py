"""Weights that several graphs of one artifacts directory share, loaded once.

`python -m export` stores a tensor that the encoder and the decoder both hold (the shared
token embedding, equal position tables) once, in one external data file that both graph
files name at the same offset (`export.graphs.store_weights_externally`). Each ONNX Runtime
session would map those bytes for itself: two mappings of one file, which count twice in
the process's resident memory wherever both sessions touch them. Here the bytes are mapped
once (a read-only numpy memmap: file-backed pages, loaded as they are read) and the one
OrtValue over them is handed to every session that names them
(`SessionOptions.add_initializer`), so the process holds one copy.

Older exports, where each graph holds its own copy, share nothing and load as before.
Reading the graph files takes the minimal protobuf reader of `tfserve.artifacts.manifest` (the
serving
path has no `onnx` package, and ONNX Runtime does not show where an initializer is stored).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
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


def shared_initializers(graphs: Sequence[Path]) -> list[dict[str, ort.OrtValue]]:
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
    values: dict[tuple[Path, int, int], ort.OrtValue | None] = {}
    shared: list[dict[str, ort.OrtValue]] = [{} for _ in graphs]
    for number, (path, tensors) in enumerate(zip(graphs, declared)):
        for tensor in tensors:
            key = _key(path, tensor)
            if len(holders[key]) < 2:
                continue
            if key not in values:
                values[key] = _mapped(key[0], tensor)
            value = values[key]
            if value is not None:
                shared[number][tensor.name] = value
    return shared


def _key(graph: Path, tensor: ExternalTensor) -> tuple[Path, int, int]:
    """The bytes a tensor names: its file (links resolved), offset and length."""
    return (graph.parent / tensor.location).resolve(), tensor.offset, tensor.length


def _mapped(file: Path, tensor: ExternalTensor) -> ort.OrtValue | None:
    """An OrtValue over the tensor's bytes in `file`, mapped read-only (None when they do
    not make the tensor the graph declares)."""
    dtype = NUMPY_TYPES.get(tensor.data_type)
    if dtype is None or tensor.offset % ALIGNMENT:
        return None
    count = int(np.prod(tensor.dims, dtype=np.int64))
    if count * np.dtype(dtype).itemsize != tensor.length:
        return None
    try:
        if tensor.offset + tensor.length > file.stat().st_size:
            return None
        array = np.memmap(file, dtype=dtype, mode="r", offset=tensor.offset,
                          shape=tensor.dims)
    except (OSError, ValueError):
        return None
    # the OrtValue keeps the memmap alive and reads its pages where they are (no copy)
    return ort.OrtValue.ortvalue_from_numpy(array)

