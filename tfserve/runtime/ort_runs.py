"""ONNX Runtime runs, in one place: what they are counted in, the small graphs the placements
build, their sessions, and one IO-bound run that updates the counters.

Every placement of the KV cache (`tfserve.runtime.cache`, `tfserve.runtime.static_cache`) and
the small graphs it runs beside the decoder (the row operations of
`tfserve.runtime.cache_graphs`, the draw of `tfserve.runtime.sampling_graph`, the static
cross write of `tfserve.runtime.static_step`) count their runs and the bytes they move
between host and device memory in one `RunCounters`, which
`python -m tfserve.bench.step_profile --search` reports per step. This module imports
nothing of tfserve, so each of them may import it (the counters once lived in `cache.py`,
which imports the graphs' modules: a circle).

Imports numpy and onnxruntime (and `onnx`, when a graph is built).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnxruntime as ort

OPSET = 17  # the small graphs' opset
HOST = "cpu"  # an output bound to host memory (OrtValue's device name)


@dataclass
class RunCounters:
    """What a cache placement has done since it was made: ONNX Runtime runs (the graphs'
    and the row operations'), and bytes copied from host to device memory and back. A host
    placement moves nothing between memories: its byte counts stay 0."""

    runs: int = 0
    to_device: int = 0
    to_host: int = 0

    def snapshot(self) -> RunCounters:
        return replace(self)

    def since(self, before: RunCounters) -> RunCounters:
        """The difference from an earlier snapshot."""
        return RunCounters(self.runs - before.runs, self.to_device - before.to_device,
                           self.to_host - before.to_host)


def float_element(dtype: Any) -> int:
    """The ONNX element type of a cache's float dtype (float16, else float32)."""
    from onnx import TensorProto

    return TensorProto.FLOAT16 if np.dtype(dtype) == np.float16 else TensorProto.FLOAT


def model_bytes(graph: Any) -> bytes:
    """A small graph (onnx's GraphProto) as a serialized model at OPSET (IR version 8, which
    every supported ONNX Runtime reads)."""
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model.SerializeToString()


def small_session(model: bytes, providers: list[Any]) -> ort.InferenceSession:
    """A session for one of the small graphs, on the decoder's providers (errors only in
    the log)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model, sess_options=options, providers=providers)


# where `bound_run` binds an output: HOST, a device (an OrtValue device name and index,
# a new tensor made by the run), or an OrtValue of the caller's (written in place)
Target = str | tuple[str, int] | ort.OrtValue


def bound_run(session: ort.InferenceSession, counters: RunCounters, *,
              binding: ort.IOBinding | None = None,
              host_inputs: Mapping[str, np.ndarray] | None = None,
              conditions: Mapping[str, np.ndarray] | None = None,
              inputs: Mapping[str, ort.OrtValue] | None = None,
              outputs: Sequence[tuple[str, Target]] = ()) -> list[ort.OrtValue]:
    """One run with IO binding, counted: `host_inputs` copied to the device (their bytes
    counted), `conditions` bound from host memory where ONNX Runtime reads them (an If's
    condition: nothing moves), `inputs` bound as they are, `outputs` bound in this order to
    their targets. -> the bound outputs, in binding order (a binding the caller keeps
    returns its earlier outputs first: clear them before). Outputs fetched to the host are
    counted by `fetch`."""
    if binding is None:
        binding = session.io_binding()
    for name, array in (host_inputs or {}).items():
        binding.bind_cpu_input(name, array)
        counters.to_device += array.nbytes
    for name, array in (conditions or {}).items():
        binding.bind_cpu_input(name, array)
    for name, value in (inputs or {}).items():
        binding.bind_ortvalue_input(name, value)
    for name, target in outputs:
        if isinstance(target, ort.OrtValue):
            binding.bind_ortvalue_output(name, target)
        elif isinstance(target, tuple):
            binding.bind_output(name, *target)
        else:
            binding.bind_output(name, target)
    counters.runs += 1
    session.run_with_iobinding(binding)
    return list(binding.get_outputs())


def run_kept_binding(session: ort.InferenceSession, binding: ort.IOBinding,
           counters: RunCounters) -> None:
    """One run of a binding bound once and kept (the static cache's step), counted."""
    counters.runs += 1
    session.run_with_iobinding(binding)


def fetch(value: ort.OrtValue, counters: RunCounters) -> np.ndarray:
    """An output bound to host memory (or read from the device), as numpy, counted."""
    array = value.numpy()
    counters.to_host += array.nbytes
    return array


def host_run(session: ort.InferenceSession, counters: RunCounters, outputs: list[str],
             feeds: Mapping[str, Any]) -> list[np.ndarray]:
    """One run with plain feeds and fetches (the host placement's: nothing crosses a
    memory boundary), counted."""
    counters.runs += 1
    return session.run(outputs, dict(feeds))
