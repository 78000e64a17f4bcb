"""The device placement of the KV cache: OrtValues in the execution provider's memory.

Each run uses IO binding (one binding per session, kept and rebound), so the cross and
present K/V stay on the device and are bound as the next step's inputs, and a step moves only
token ids, masks and the top candidates between host and device; the [B,T,V] logits only
when the step is asked for them, the encoder's hidden states never (Encode reads them
through `Runtime.hidden_states`). Row operations (rows joining or leaving) run on the device
too, as small ONNX graphs (`tfserve.runtime.cache_graphs`).

How it honours the step contract (`tfserve.step`):

- `parents` (a beam step's reorder): where the decoder graph takes `cache_rows`
  (`tfserve.runtime.step_graph`: the rewrite made at load), bound as that input, and the
  step's one run gathers the rows; on a graph without it, a `take` run of its own first.
- `draws`: where the decoder graph has the draw (`sampling_graph.add_draw`), bound as its
  inputs and made in the step's one run; on a graph without it the step's logits are bound
  to the device and the standalone draw graph runs on them (`DeviceSampler`: a second run).

The graph without either is what a runtime that cannot rewrite the decoder at load runs
(ONNX Runtime before 1.21, or no `onnx`): the fallback, which
tests/runtime/test_device_step.py forces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.runtime.cache import CacheStorage, DecoderNames
from tfserve.runtime.cache_graphs import DeviceCacheOps
from tfserve.runtime.ort_runs import HOST, Target, bound_run, fetch
from tfserve.runtime.sampling_graph import (
    DRAW,
    DRAW_INPUTS,
    DRAW_OUTPUTS,
    DRAW_TOP_K,
    DRAW_TOP_P,
    DeviceSampler,
    draw_feeds,
)
from tfserve.runtime.step_graph import CACHE_ROWS
from tfserve.step import SampleDraws, StepOutput, narrow_first


class DeviceCache(CacheStorage):
    """OrtValues in the memory of device `memory` (an OrtValue device name: 'cuda', or
    'cpu' where the device path is tested without a GPU) number `index`."""

    draws_on_device = True

    def __init__(self, tensors: int, heads: int, head_dim: int, dtype: type[np.floating],
                 memory: str, index: int, providers: list[Any]) -> None:
        super().__init__(tensors, heads, head_dim, dtype)
        self.memory, self.index = memory, index
        self.providers = providers
        self.ops = DeviceCacheOps(tensors, dtype, memory, index, providers, self.counters)
        # the standalone draw graph: for steps of a decoder graph without the draw
        self.sampler = DeviceSampler(memory, index, providers, self.counters)
        # per decoder session: its input names, and the vocabulary of its logits where its
        # graph has the draw (0 where the graph leaves it open; None: no draw)
        self._inputs: dict[int, frozenset[str]] = {}
        self._draw_vocab: dict[int, int | None] = {}
        # one IO binding per session, rebound every run: inputs replace their previous
        # binding by name; outputs are cleared and bound again (whether the logits are
        # fetched changes from step to step)
        self._bindings: dict[int, ort.IOBinding] = {}

    @property
    def device(self) -> tuple[str, int]:
        """Where new tensors of a run are made (a `bound_run` target)."""
        return self.memory, self.index

    def _binding(self, session: ort.InferenceSession) -> ort.IOBinding:
        binding = self._bindings.get(id(session))
        if binding is None:
            binding = self._bindings[id(session)] = session.io_binding()
        binding.clear_binding_outputs()
        return binding

    def _takes(self, decoder: ort.InferenceSession, name: str) -> bool:
        """Whether the decoder graph has the input `name`."""
        inputs = self._inputs.get(id(decoder))
        if inputs is None:
            inputs = self._inputs[id(decoder)] = frozenset(
                value.name for value in decoder.get_inputs())
        return name in inputs

    def _draws_in(self, decoder: ort.InferenceSession, logits: str) -> int | None:
        """Where the decoder graph makes the step's draws (it has the input DRAW), the
        vocabulary of its `logits` output [B,T,V] (0: not fixed by the graph); else None."""
        if id(decoder) not in self._draw_vocab:
            vocab = None
            if self._takes(decoder, DRAW):
                shape = next(value.shape for value in decoder.get_outputs()
                             if value.name == logits)
                vocab = shape[-1] if isinstance(shape[-1], int) else 0
            self._draw_vocab[id(decoder)] = vocab
        return self._draw_vocab[id(decoder)]

    def _fetch(self, value: ort.OrtValue) -> np.ndarray:
        """An output bound to host memory, as numpy."""
        return fetch(value, self.counters)

    def run_encoder(self, encoder: ort.InferenceSession, feeds: dict[str, np.ndarray],
                    outputs: list[str]) -> tuple[Any, list[Any]]:
        """-> the hidden states [B,S,D] as an OrtValue on the device (the search has no use
        for them on the host), and the cross K/V there."""
        values = bound_run(encoder, self.counters, binding=self._binding(encoder),
                           host_inputs=feeds, outputs=[(name, self.device) for name in outputs])
        return values[0], values[1:]

    def run_decoder(self, decoder: ort.InferenceSession, names: DecoderNames,
                    feeds: dict[str, np.ndarray], past: Any, cross: Any,
                    need_logits: bool = True, parents: np.ndarray | None = None,
                    draws: SampleDraws | None = None) -> StepOutput:
        feeds = dict(feeds)
        if self._takes(decoder, CACHE_ROWS):  # the step's run gathers the parents' rows
            rows = feeds["input_ids"].shape[0]
            feeds[CACHE_ROWS] = (np.arange(rows, dtype=np.int64) if parents is None
                                 else np.ascontiguousarray(parents, dtype=np.int64))
        elif parents is not None:  # a graph without cache_rows: a take run first
            past = self.take_rows(past, parents)
        inputs = {name: self._device_value(value)
                  for name, value in zip(names.past + names.cross, [*past, *cross])}
        # the draws in the step's own run where the graph has the draw; else the logits
        # stay on the device for the standalone draw graph's run
        vocab = self._draws_in(decoder, names.outputs[0])
        apart = draws is not None and vocab is None
        conditions: dict[str, np.ndarray] = {}
        if vocab is not None:  # every run binds the draw inputs: empty, the If off, if none
            given = draw_feeds(draws, vocab)
            feeds.update((name, given[name]) for name in DRAW_INPUTS)
            conditions = {name: given[name] for name in (DRAW, DRAW_TOP_K, DRAW_TOP_P)}
        logits_to: Target | None = HOST if need_logits and not apart else (
            self.device if apart else None)  # None: unbound, made on the device, never copied
        outputs: list[tuple[str, Target]] = [] if logits_to is None else [
            (names.outputs[0], logits_to)]
        outputs += [(name, self.device) for name in names.outputs[1:]]
        outputs += [(name, HOST) for name in names.top_outputs]
        in_run = draws is not None and vocab is not None
        if in_run:
            outputs += [(name, HOST) for name in DRAW_OUTPUTS]
        values = bound_run(decoder, self.counters, binding=self._binding(decoder),
                           host_inputs=feeds, conditions=conditions, inputs=inputs,
                           outputs=outputs)
        logits_value = values.pop(0) if logits_to is not None else None
        drawn: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        if in_run:  # the draws' outputs, bound last
            drawn = (self._fetch(values[-2]), self._fetch(values[-1]))
            values = values[:-2]
        elif apart:
            drawn = self.sampler.draw(logits_value, draws)  # type: ignore[arg-type]
        logits = None
        if need_logits and logits_value is not None:
            logits = self._fetch(logits_value).astype(np.float32, copy=False)
        cache_end = len(values) - len(names.top_outputs)
        return StepOutput(logits, values[:cache_end],
                          *[self._fetch(value) for value in values[cache_end:]], *drawn)

    def _device_value(self, value: Any) -> ort.OrtValue:
        """A tensor as an OrtValue on the device (copied there when it is a numpy array)."""
        if isinstance(value, ort.OrtValue):
            return value
        array = np.ascontiguousarray(value)
        self.counters.to_device += array.nbytes
        return ort.OrtValue.ortvalue_from_numpy(array, self.memory, self.index)

    def _device(self, cache: Sequence[Any]) -> list[ort.OrtValue]:
        return [self._device_value(v) for v in cache]

    def empty_past(self, rows: int) -> list[Any]:
        return self._device(self._zeros(rows))

    def take_rows(self, cache: Sequence[Any], index: np.ndarray, reuse: bool = False
                  ) -> list[Any]:
        return self.ops.take(self._device(cache), index)

    def concat_rows(self, caches: Sequence[Sequence[Any]], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> list[Any]:
        if first_rows is not None or first_time is not None:
            caches = narrow_first(self, caches, first_rows, first_time)
        if length is not None:
            caches = [self.pad_time(cache, length, left) for cache in caches]
        joined = self._device(caches[0])
        for other in caches[1:]:
            joined = self.ops.concat(joined, self._device(other))
        return joined

    def pad_time(self, cache: Sequence[Any], length: int, left: bool) -> list[Any]:
        cache = self._device(cache)
        extra = length - cache[0].shape()[2]
        return self.ops.pad_time(cache, extra, left) if extra > 0 else cache

    def slice_time(self, cache: Sequence[Any], start: int, stop: int) -> list[Any]:
        return self.ops.slice_time(self._device(cache), start, stop)
