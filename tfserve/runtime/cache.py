"""Where the KV cache lives between decoder steps: two placements behind one interface.

`HostCache`: numpy arrays in host memory, [k_0, v_0, k_1, v_1, ...], each [B,H,P,Dh]; the
graphs run with plain feeds and fetches, and row operations are numpy copies (spread over the
numpy thread pool when large).

`DeviceCache`: OrtValues in the execution provider's memory; each run uses IO binding (one
binding per session, kept and rebound), so the cross and present K/V stay on the device and
are bound as the next step's inputs, and a step moves only token ids, masks and the top
candidates between host and device; the [B,T,V] logits only when the step is asked for them,
the encoder's hidden states never (Encode reads them through `Runtime.hidden_states`). Row
operations (beam reorder, rows joining or leaving) run on the device too, as small ONNX
graphs (`tfserve.runtime.cache_graphs`). Sampling rows that need whole rows of the logits
draw there as well (`draws_on_device`), by the nodes of `tfserve.runtime.sampling_graph`:
a step run inside `logits_kept(draws)` makes the draws in its own run where the decoder
graph has them (`tfserve.runtime.step_graph`: the device placement's rewrite), and `draw`
hands them over; on a decoder graph without them the step keeps its logits on the device,
and `draw` runs the standalone draw graph on them (a second run).

Both count their ONNX Runtime runs and the bytes they move between host and device memory
(`RunCounters`), which `python -m tfserve.bench.step_profile --search` reports per step.

`Runtime` picks one at construction and hands it every cache operation and every run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.generation import StepOutput, narrow_first, numpy_pool
from tfserve.generation.search import SampleDraws
from tfserve.runtime.cache_graphs import DeviceCacheOps
from tfserve.runtime.sampling_graph import (
    DRAW,
    DRAW_OUTPUTS,
    DeviceSampler,
    draw_feeds,
    moved_bytes,
)

POOL_MIN_BYTES = 4 << 20  # cache row operations below this total size run on one thread


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


class CacheStorage(ABC):
    """The runs of the two graphs and the `generation.Backend` cache row operations, for
    one placement of the cache. A cache is a list of 2L tensors [B,H,P,Dh]."""

    # whether `logits_kept` and `draw` make a step's samples where its logits are, so that
    # no row of them comes to the host (DecodeBatch asks): the device placement's. On the
    # host there is no boundary to spare: the searches draw from the numpy rows
    draws_on_device = False

    def __init__(self, tensors: int, heads: int, head_dim: int, dtype: type[np.floating]
                 ) -> None:
        self.tensors = tensors  # 2L: a key and a value per decoder layer
        self.heads, self.head_dim = heads, head_dim
        self.dtype = dtype
        self.counters = RunCounters()

    @abstractmethod
    def run_encoder(self, encoder: ort.InferenceSession, feeds: dict[str, np.ndarray],
                    outputs: list[str]) -> tuple[np.ndarray, list[Any]]:
        """-> outputs[0] (hidden states [B,S,D]) as numpy, the rest (cross K/V) as a cache."""

    @abstractmethod
    def run_decoder(self, decoder: ort.InferenceSession, feeds: dict[str, np.ndarray],
                    past_names: list[str], past: Sequence[Any], cross_names: list[str],
                    cross: Sequence[Any], outputs: list[str], top_outputs: list[str],
                    need_logits: bool = True) -> StepOutput:
        """One decoder run: feeds are the host inputs (ids, positions, masks); outputs[0] is
        the logits (fetched only when need_logits), outputs[1:] the present K/V;
        top_outputs, fetched to the host after them, the graph's top candidates (empty
        where the graph has none)."""

    @abstractmethod
    def empty_past(self, rows: int) -> list[Any]:
        """A self-attention cache of length 0 for `rows` rows."""

    @abstractmethod
    def take_rows(self, cache: Sequence[Any], index: np.ndarray, reuse: bool = False
                  ) -> list[Any]:
        """See `generation.Backend.take_rows`."""

    @abstractmethod
    def concat_rows(self, caches: Sequence[Sequence[Any]], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> list[Any]:
        """See `generation.Backend.concat_rows`."""

    @abstractmethod
    def pad_time(self, cache: Sequence[Any], length: int, left: bool) -> list[Any]:
        """See `generation.Backend.pad_time`."""

    @abstractmethod
    def slice_time(self, cache: Sequence[Any], start: int, stop: int) -> list[Any]:
        """See `generation.Backend.slice_time`."""

    def _zeros(self, rows: int) -> list[np.ndarray]:
        shape = (rows, self.heads, 0, self.head_dim)  # [B,H,0,Dh]
        return [np.zeros(shape, self.dtype) for _ in range(self.tensors)]


class HostCache(CacheStorage):
    """numpy arrays in host memory."""

    def run_encoder(self, encoder: ort.InferenceSession, feeds: dict[str, np.ndarray],
                    outputs: list[str]) -> tuple[np.ndarray, list[Any]]:
        self.counters.runs += 1
        hidden, *cross = encoder.run(outputs, feeds)
        return hidden, cross

    def run_decoder(self, decoder: ort.InferenceSession, feeds: dict[str, np.ndarray],
                    past_names: list[str], past: Sequence[Any], cross_names: list[str],
                    cross: Sequence[Any], outputs: list[str], top_outputs: list[str],
                    need_logits: bool = True) -> StepOutput:
        feeds = dict(feeds)
        feeds.update(zip(past_names, past))
        feeds.update(zip(cross_names, cross))
        self.counters.runs += 1
        fetched = decoder.run((outputs if need_logits else outputs[1:]) + top_outputs, feeds)
        logits = fetched.pop(0).astype(np.float32, copy=False) if need_logits else None
        cache_end = len(outputs) - 1
        return StepOutput(logits, fetched[:cache_end], *fetched[cache_end:])

    def empty_past(self, rows: int) -> list[Any]:
        return self._zeros(rows)

    def _each(self, fn: Callable[[Any], np.ndarray], cache: Sequence[Any],
              nbytes: int | None = None) -> list[np.ndarray]:
        """fn over every tensor of a cache; nbytes: the data moved, when `cache` is not the
        tensors themselves."""
        # one tensor per thread: numpy releases the GIL while copying, and the fresh pages of
        # 2L new arrays fault in in parallel (3-4x faster on 2 cores). Small caches stay on
        # this thread: handing them to the pool costs more than the copies (a demo-sized join
        # of 4 rows into 28: 1.1 ms in a loop, 2.6 ms through the pool)
        if nbytes is None:
            nbytes = sum(t.nbytes for t in cache)
        if nbytes < POOL_MIN_BYTES:
            return [fn(t) for t in cache]
        return list(numpy_pool().map(fn, cache))

    def take_rows(self, cache: Sequence[Any], index: np.ndarray, reuse: bool = False
                  ) -> list[Any]:
        rows = cache[0].shape[0] if len(cache) else 0
        if reuse and len(index) == rows and all(t.flags.writeable for t in cache):
            # a beam step keeps the row count and most rows keep their own history: copy only
            # the rows whose parent is another row, in place (t[src] is gathered before the
            # write, so overlapping moves are safe). Measured on beam 4 x 32 rows of an
            # opus-mt-base-sized model: 8% faster per step than gathering every row anew.
            moved = np.flatnonzero(index != np.arange(rows))
            src = index[moved]

            def move(t: np.ndarray) -> np.ndarray:
                t[moved] = t[src]
                return t

            return self._each(move, cache) if len(moved) else list(cache)
        return self._each(lambda t: t[index], cache)  # fancy indexing: faster than np.take

    def concat_rows(self, caches: Sequence[Sequence[Any]], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> list[Any]:
        if (first_rows is not None or first_time is not None) and length is None:
            caches = narrow_first(self, caches, first_rows, first_time)
            first_rows = first_time = None
        if length is None:
            return self._each(lambda i: np.concatenate([c[i] for c in caches], axis=0),
                              range(len(caches[0])), sum(t.nbytes for c in caches for t in c))

        counts = [c[0].shape[0] if len(c) else 0 for c in caches]
        if first_rows is not None:
            counts[0] = len(first_rows)

        def stack(i: int) -> np.ndarray:
            # one pass: each part copied into its rows (the first cache's `first_rows` only),
            # only the padding zeroed (padding first and stacking after copied the whole
            # cache twice)
            first = caches[0][i]
            out = np.empty((sum(counts), first.shape[1], length, first.shape[3]), first.dtype)
            row = 0
            for part_index, cache in enumerate(caches):
                part = cache[i]
                if part_index == 0 and first_time is not None:
                    part = part[:, :, first_time[0]:first_time[1]]  # a view: copied below
                if part.dtype != out.dtype or part.shape[2] > length:
                    raise ValueError(f"concat_rows: a {part.dtype} part of length "
                                     f"{part.shape[2]} cannot join {out.dtype} rows of "
                                     f"length {length}")
                end = row + counts[part_index]
                _place(out[row:end], part, left, first_rows if part_index == 0 else None)
                row = end
            return out

        nbytes = sum(t.nbytes for c in caches for t in c)
        return self._each(stack, range(len(caches[0])), nbytes)

    def pad_time(self, cache: Sequence[Any], length: int, left: bool) -> list[Any]:
        def pad(t: np.ndarray) -> np.ndarray:
            if t.shape[2] >= length:
                return t
            # one slice copy and the padding zeroed: several times faster than np.pad here
            out = np.empty((t.shape[0], t.shape[1], length, t.shape[3]), t.dtype)  # [B,H,L,Dh]
            _place(out, t, left)
            return out

        return self._each(pad, cache)

    def slice_time(self, cache: Sequence[Any], start: int, stop: int) -> list[Any]:
        return self._each(lambda t: np.ascontiguousarray(t[:, :, start:stop]), cache)


class DeviceCache(CacheStorage):
    """OrtValues in the memory of device `memory` (an OrtValue device name: 'cuda', or
    'cpu' where the device path is tested without a GPU) number `index`."""

    draws_on_device = True

    def __init__(self, tensors: int, heads: int, head_dim: int, dtype: type[np.floating],
                 memory: str, index: int, providers: list[Any]) -> None:
        super().__init__(tensors, heads, head_dim, dtype)
        self.memory, self.index = memory, index
        self.ops = DeviceCacheOps(tensors, dtype, memory, index, providers, self.counters)
        # the standalone draw graph: for steps of a decoder graph without the draw
        self.sampler = DeviceSampler(memory, index, providers, self.counters)
        # inside logits_kept(): a step that does not fetch its logits binds them to the
        # device, and the last such step's [B,T,V] OrtValue waits here for `draw`; or,
        # where the decoder graph draws (`_draws_in`), the step makes `_step_draws` and
        # their tokens and log-probabilities wait in `_drawn`
        self._keep_logits = False
        self.step_logits: ort.OrtValue | None = None
        self._step_draws: SampleDraws | None = None
        self._drawn: tuple[SampleDraws, np.ndarray, np.ndarray] | None = None
        # per decoder session whose graph has the draw (sampling_graph.add_draw): the
        # vocabulary of its logits (0 where the graph leaves it open); None: no draw
        self._draw_vocab: dict[int, int | None] = {}
        # one IO binding per session, rebound every run: inputs replace their previous
        # binding by name; outputs are cleared and bound again (whether the logits are
        # fetched changes from step to step)
        self._bindings: dict[int, ort.IOBinding] = {}

    def _binding(self, session: ort.InferenceSession) -> ort.IOBinding:
        binding = self._bindings.get(id(session))
        if binding is None:
            binding = self._bindings[id(session)] = session.io_binding()
        binding.clear_binding_outputs()
        return binding

    @contextmanager
    def logits_kept(self, draws: SampleDraws | None = None) -> Iterator[None]:
        """Steps run inside make `draws` (rows of the step) in their own run where the
        decoder graph draws, and keep the logits they do not fetch on the device where it
        does not, for `draw`; both are let go on the way out."""
        self._keep_logits = True
        self._step_draws = draws
        try:
            yield
        finally:
            self._keep_logits = False
            self._step_draws = self._drawn = None
            self.step_logits = None

    def draw(self, draws: SampleDraws) -> tuple[np.ndarray, np.ndarray]:
        """Draws from the rows of the last step's logits, on the device
        (`tfserve.runtime.sampling_graph`): token ids [S] int64, log-probabilities [S].
        Those the step made, where they are these `draws`; else a run of the standalone
        draw graph on the logits the step kept."""
        if self._drawn is not None and self._drawn[0] is draws:
            return self._drawn[1], self._drawn[2]
        if self.step_logits is None:
            raise RuntimeError("no step's logits are kept on the device: draw inside "
                               "logits_kept(), after a step that did not fetch them")
        return self.sampler.draw(self.step_logits, draws)

    def _draws_in(self, decoder: ort.InferenceSession, logits: str) -> int | None:
        """Where the decoder graph makes the step's draws (it has the input DRAW), the
        vocabulary of its `logits` output [B,T,V] (0: not fixed by the graph); else None."""
        if id(decoder) not in self._draw_vocab:
            vocab = None
            if any(value.name == DRAW for value in decoder.get_inputs()):
                shape = next(value.shape for value in decoder.get_outputs()
                             if value.name == logits)
                vocab = shape[-1] if isinstance(shape[-1], int) else 0
            self._draw_vocab[id(decoder)] = vocab
        return self._draw_vocab[id(decoder)]

    def _bind_host_inputs(self, binding: ort.IOBinding, feeds: dict[str, np.ndarray]) -> None:
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
            self.counters.to_device += value.nbytes

    def _fetch(self, value: ort.OrtValue) -> np.ndarray:
        """An output bound to host memory, as numpy."""
        array = value.numpy()
        self.counters.to_host += array.nbytes
        return array

    def run_encoder(self, encoder: ort.InferenceSession, feeds: dict[str, np.ndarray],
                    outputs: list[str]) -> tuple[Any, list[Any]]:
        """-> the hidden states [B,S,D] as an OrtValue on the device (the search has no use
        for them on the host), and the cross K/V there."""
        binding = self._binding(encoder)
        self._bind_host_inputs(binding, feeds)
        for name in outputs:
            binding.bind_output(name, self.memory, self.index)
        self.counters.runs += 1
        encoder.run_with_iobinding(binding)
        values = binding.get_outputs()
        return values[0], list(values[1:])

    def run_decoder(self, decoder: ort.InferenceSession, feeds: dict[str, np.ndarray],
                    past_names: list[str], past: Sequence[Any], cross_names: list[str],
                    cross: Sequence[Any], outputs: list[str], top_outputs: list[str],
                    need_logits: bool = True) -> StepOutput:
        binding = self._binding(decoder)
        self._bind_host_inputs(binding, feeds)
        for name, value in zip(past_names + cross_names, list(past) + list(cross)):
            binding.bind_ortvalue_input(name, self._device_value(value))

        def bind_present(names: list[str]) -> None:  # new device tensors, made by the run
            for name in names:
                binding.bind_output(name, self.memory, self.index)

        logits, present, tops = self._run_step(decoder, binding, outputs, top_outputs,
                                               need_logits, bind_present)
        return StepOutput(logits, present, *tops)

    def _run_step(self, decoder: ort.InferenceSession, binding: ort.IOBinding,
                  outputs: list[str], top_outputs: list[str], need_logits: bool,
                  bind_present: Callable[[list[str]], None]
                  ) -> tuple[np.ndarray | None, list[ort.OrtValue], list[np.ndarray]]:
        """The step's one run on its bound inputs: the logits bound to the host only when
        asked for, the present K/V as `bind_present` binds them (outputs[1:]), the top
        candidates to the host. (logits or None, the present K/V, the top candidates)."""
        # the step's draws (logits_kept), made in this run where the graph has the draw
        vocab = self._draws_in(decoder, outputs[0])
        draws = self._step_draws if vocab is not None else None
        self._drawn = None
        kept = self._keep_logits and not need_logits and draws is None
        if need_logits:  # else the logits stay unbound: made on the device, never copied
            binding.bind_output(outputs[0], "cpu")
        elif kept:  # or bound there, for a standalone run of the draws (logits_kept)
            binding.bind_output(outputs[0], self.memory, self.index)
        bind_present(outputs[1:])
        for name in top_outputs:
            binding.bind_output(name, "cpu")
        if vocab is not None:  # every run binds the draw inputs: empty, the If off, if none
            feeds = draw_feeds(draws, vocab)
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            self.counters.to_device += moved_bytes(feeds)
            if draws is not None:
                for name in DRAW_OUTPUTS:
                    binding.bind_output(name, "cpu")
        self.counters.runs += 1
        decoder.run_with_iobinding(binding)
        values = binding.get_outputs()
        logits = self._fetch(values[0]).astype(np.float32, copy=False) if need_logits else None
        self.step_logits = values[0] if kept else None
        if draws is not None:  # the draws' outputs, bound last
            token, log_prob = (self._fetch(value) for value in values[-len(DRAW_OUTPUTS):])
            self._drawn = (draws, token, log_prob)
            values = values[: -len(DRAW_OUTPUTS)]
        cache_end = len(values) - len(top_outputs)
        return (logits, list(values[int(need_logits or kept) : cache_end]),
                [self._fetch(value) for value in values[cache_end:]])

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


def _place(out: np.ndarray, part: np.ndarray, left: bool, rows: np.ndarray | None = None
           ) -> None:
    """Write part [N,H,p,Dh] (or its `rows`) into out [N,H,length,Dh] (p <= length) on the
    left or the right of the time axis, and zero the rest of it."""
    p = part.shape[2]
    extra = out.shape[2] - p
    target = out[:, :, extra:] if left else out[:, :, :p]
    if rows is None:
        target[...] = part
    else:
        np.take(part, rows, axis=0, out=target)  # gathered straight into place
    if left:
        out[:, :, :extra] = 0
    else:
        out[:, :, p:] = 0
