"""On CPU: let ONNX Runtime pre-pack the tied output projection's weight.

Graph revision 8 stores the tied token table once and lists it among the decoder graph's
inputs as well as its initializers (an overridable initializer): ONNX Runtime never pre-packs
an input, so the output projection (`FusedMatMul(hidden, table, transB=1)`) reads the one
table, and the process holds one copy of it. The price is speed on CPU: MLAS packs the table
again at every step. For the opus-mt-base-sized model in fp32 at batch 16, 2 threads, the
projection took 7.5-8.5 ms a step that way against 5.1-5.2 ms pre-packed
(docs/benchmarks.md).

`constant_weights` removes those inputs from the graph's bytes, so that ONNX Runtime takes the
table as a constant and pre-packs it: the projection's fastest kernel. The table stays the one
mapped buffer both sessions are given (`tfserve.runtime.shared_weights`); its pages leave the
process as packing reads them and only the rows the embedding lookups read come back, so the
packed copy takes the table's place in memory rather than adding to it.
`Runtime(pack_weights=...)` (`--pack-weights`) chooses; on CPU it does by default. The
rewrite reads and writes the protobuf fields itself (the serving path has no `onnx` package)
and touches nothing but the graph's `input` entries.
"""

from __future__ import annotations

from tfserve.artifacts.manifest import (
    _GRAPH_INITIALIZER,
    _LENGTH,
    _MODEL_GRAPH,
    _TENSOR_NAME,
    _field_spans,
)

_GRAPH_INPUT = 11  # GraphProto.input
_VALUE_INFO_NAME = 1  # ValueInfoProto.name


def constant_weights(model: bytes) -> tuple[bytes, list[str]]:
    """The ModelProto `model` without the graph inputs that name an initializer, and their
    names (none: `model` as it is)."""
    graph_field = next((field for field in _field_spans(model, 0, len(model))
                        if field[0] == _MODEL_GRAPH and field[1] == _LENGTH), None)
    if graph_field is None:
        return model, []
    _, _, field_start, start, end = graph_field
    fields = list(_field_spans(model, start, end))
    stored = {_name(model, a, b, _TENSOR_NAME) for number, wire, _, a, b in fields
              if number == _GRAPH_INITIALIZER and wire == _LENGTH}
    dropped, kept = [], []
    for number, wire, first, a, b in fields:
        if number == _GRAPH_INPUT and wire == _LENGTH:
            name = _name(model, a, b, _VALUE_INFO_NAME)
            if name in stored:
                dropped.append(name)
                continue
        kept.append(model[first:b])
    if not dropped:
        return model, []
    graph = b"".join(kept)
    key = bytes([(_MODEL_GRAPH << 3) | _LENGTH])
    return model[:field_start] + key + _encode_varint(len(graph)) + graph + model[end:], dropped


def _name(data: bytes, start: int, end: int, field: int) -> str:
    """The string field `field` of the message in data[start:end] ("" without it)."""
    for number, wire, _, a, b in _field_spans(data, start, end):
        if number == field and wire == _LENGTH:
            return data[a:b].decode("utf-8", errors="replace")
    return ""


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
