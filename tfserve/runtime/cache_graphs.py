"""KV-cache row operations that run inside ONNX Runtime, so a device-resident cache stays put
(`tfserve.runtime.cache.DeviceCache`).

On CUDA the decoder's present K/V are OrtValues in GPU memory. Continuous batching and beam
search need four operations on them between steps: take rows (reorder / drop / duplicate),
concatenate rows, zero-pad the time axis, slice the time axis. Doing them with numpy would
copy the cache to the host and back every step; instead each is a tiny ONNX graph (Gather,
Concat, Pad, Slice over all 2L cache tensors at once) run on the same device with IO binding.

The graphs are built here with `onnx.helper` (the `onnx` package comes with the `gpu` extra).
The same code runs on CPU with CPU OrtValues, which is how the tests check it without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.runtime.ort_runs import (
    RunCounters,
    bound_run,
    float_element,
    model_bytes,
    small_session,
)


def _graph_bytes(kind: str, count: int, elem_type: int) -> bytes:
    """A model applying one op to `count` float tensors [B,H,P,Dh] -> `count` outputs."""
    from onnx import TensorProto, helper

    shape = ["batch", "heads", "time", "head_dim"]
    inputs, outputs, nodes = [], [], []
    extra: list[Any] = []
    if kind == "take":
        extra = [helper.make_tensor_value_info("index", TensorProto.INT64, ["rows"])]
    elif kind == "pad":  # pads [8]: begin and end per axis
        extra = [helper.make_tensor_value_info("pads", TensorProto.INT64, [8])]
    elif kind == "slice":
        extra = [helper.make_tensor_value_info(n, TensorProto.INT64, [1])
                 for n in ("starts", "ends", "axes")]
    arity = 2 if kind == "concat" else 1
    for i in range(count):
        names = [f"x{i}_{j}" for j in range(arity)]
        inputs += [helper.make_tensor_value_info(n, elem_type, shape) for n in names]
        out = f"y{i}"
        outputs.append(helper.make_tensor_value_info(out, elem_type, shape))
        if kind == "take":
            nodes.append(helper.make_node("Gather", [names[0], "index"], [out], axis=0))
        elif kind == "concat":
            nodes.append(helper.make_node("Concat", names, [out], axis=0))
        elif kind == "pad":
            nodes.append(helper.make_node("Pad", [names[0], "pads"], [out], mode="constant"))
        else:
            nodes.append(helper.make_node("Slice", [names[0], "starts", "ends", "axes"], [out]))
    return model_bytes(helper.make_graph(nodes, f"cache_{kind}", inputs + extra, outputs))


class DeviceCacheOps:
    """take / concat / pad / slice over lists of OrtValues on one device."""

    def __init__(self, count: int, dtype: np.dtype, device_kind: str, device_index: int,
                 providers: list[Any], counters: RunCounters | None = None) -> None:
        """counters: the `RunCounters` that the runs and their host inputs are added to (a
        fresh one where None)."""
        self.count = count
        self.counters = counters if counters is not None else RunCounters()
        self.device_kind, self.device_index = device_kind, device_index
        elem = float_element(dtype)
        self.sessions = {kind: small_session(_graph_bytes(kind, count, elem), providers)
                         for kind in ("take", "concat", "pad", "slice")}

    def _run(self, kind: str, tensors: Sequence[ort.OrtValue], **small: np.ndarray
             ) -> list[ort.OrtValue]:
        arity = 2 if kind == "concat" else 1
        device = (self.device_kind, self.device_index)
        return bound_run(
            self.sessions[kind], self.counters,
            host_inputs={name: np.ascontiguousarray(value, dtype=np.int64)
                         for name, value in small.items()},
            inputs={f"x{i}_{j}": tensors[i * arity + j]
                    for i in range(self.count) for j in range(arity)},
            outputs=[(f"y{i}", device) for i in range(self.count)])

    def take(self, cache: Sequence[ort.OrtValue], index: np.ndarray) -> list[ort.OrtValue]:
        return self._run("take", cache, index=index)

    def concat(self, first: Sequence[ort.OrtValue],
               second: Sequence[ort.OrtValue]) -> list[ort.OrtValue]:
        paired = [t for pair in zip(first, second) for t in pair]
        return self._run("concat", paired)

    def pad_time(self, cache: Sequence[ort.OrtValue], extra: int,
                 left: bool) -> list[ort.OrtValue]:
        pads = np.zeros(8, np.int64)  # [b0, h0, t0, d0, b1, h1, t1, d1]
        pads[2 if left else 6] = extra
        return self._run("pad", cache, pads=pads)

    def slice_time(self, cache: Sequence[ort.OrtValue], start: int,
                   stop: int) -> list[ort.OrtValue]:
        return self._run("slice", cache, starts=np.array([start]), ends=np.array([stop]),
                         axes=np.array([2]))
