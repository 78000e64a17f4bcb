"""The decoder graph as the device placement runs it: one ONNX Runtime run per step.

A beam step reorders the KV cache (each new row continues its parent's history). Run as a
graph of its own (`cache_graphs.DeviceCacheOps.take`), that reorder is a second ONNX Runtime
run per step. Here the exported decoder graph gets one more input instead, `cache_rows`
int64 [B]: the row of the bound past K/V each row continues, gathered (a Gather per past
tensor, axis 0) before anything reads the past. The step then takes the previous step's
present K/V as they came out, with the parents of the rows, and does the reorder on the
device inside the one run; greedy rows pass their own index.

The step's sampling draws are part of the same run: with `draws_from` (the logits output),
the graph also gets the draw of `tfserve.runtime.sampling_graph` (`add_draw`: an If on a
bool input, bound from host memory, whose then-branch draws from the step's logits where
they were made and whose else-branch gives empty outputs), so a step with draws is one run,
and a step without them pays for an If that takes its empty branch.

The rewrite is made when the runtime loads the graph, from the graph file without its
weights (`onnx.load(load_external_data=False)`): the session reads the weights from the
artifacts directory (`session.model_external_initializers_file_folder_path`, ONNX Runtime
1.21 and later), so the artifacts stay as exported and older exports gain it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tfserve.runtime.sampling_graph import add_draw

CACHE_ROWS = "cache_rows"
# ONNX Runtime's session option naming the folder of the external data of a model loaded
# from bytes
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def reads_graph_bytes() -> bool:
    """Whether this ONNX Runtime reads a graph given as bytes with its weights in files
    (EXTERNAL_DATA_FOLDER: 1.21 and later)."""
    import onnxruntime as ort

    major, minor = (int(part) for part in ort.__version__.split(".")[:2])
    return (major, minor) >= (1, 21)


def loads_rewritten_graphs() -> bool:
    """reads_graph_bytes, and the `onnx` package is there to rewrite the graph."""
    import importlib.util

    return reads_graph_bytes() and importlib.util.find_spec("onnx") is not None


def load_decoder(decoder: Path, needed: Sequence[str]) -> Any:
    """The decoder graph at `decoder` without its weights (onnx's ModelProto), to rewrite
    with a `cache_rows` input: a ValueError when it has one already or lacks an input of
    `needed`."""
    from onnx import load

    model = load(str(decoder), load_external_data=False)
    inputs = {value.name for value in model.graph.input}
    if CACHE_ROWS in inputs:
        raise ValueError(f"{decoder} already has an input {CACHE_ROWS!r}")
    missing = [name for name in needed if name not in inputs]
    if missing:
        raise ValueError(f"{decoder} has no input {missing[0]!r}")
    return model


def rewritten_decoder(decoder: Path, past_names: list[str], draws_from: str | None = None
                      ) -> bytes:
    """The decoder graph at `decoder` (its weights left in their files) with the
    `cache_rows` input: every consumer of past_key_l / past_value_l reads
    Gather(past, cache_rows, axis 0) instead; and, where `draws_from` names its logits
    output, the step's draws (`sampling_graph.add_draw`: the inputs STEP_DRAW_INPUTS, the
    outputs DRAW_OUTPUTS)."""
    from onnx import TensorProto, helper

    model = load_decoder(decoder, past_names)
    graph = model.graph
    gathered = {name: f"{name}/{CACHE_ROWS}" for name in past_names}
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name in gathered:
                node.input[position] = gathered[name]
    for output in graph.output:
        if output.name in gathered:  # a past passed through unchanged: not a tfserve graph
            raise ValueError(f"{decoder}: the output {output.name!r} is a past input")
    gathers = [helper.make_node("Gather", [name, CACHE_ROWS], [gathered[name]], axis=0,
                                name=f"{CACHE_ROWS}/{name}") for name in past_names]
    for position, node in enumerate(gathers):  # first: the node order stays topological
        graph.node.insert(position, node)
    graph.input.append(helper.make_tensor_value_info(CACHE_ROWS, TensorProto.INT64, ["batch"]))
    if draws_from is not None:
        add_draw(graph, draws_from)
    return model.SerializeToString()
