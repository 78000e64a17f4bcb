"""Where the KV cache lives between decoder steps: the placements behind one interface, each
an implementation of the step contract (`tfserve.step`) for `Runtime`.

`HostCache` (here): numpy arrays in host memory, [k_0, v_0, k_1, v_1, ...], each [B,H,P,Dh];
the graphs run with plain feeds and fetches, and row operations are numpy copies (spread over
the numpy thread pool when large). A step's `parents` are gathered with numpy before the run;
it makes no draws (the searches draw from the numpy rows: there is no boundary to spare).

`DeviceCache` (`tfserve.runtime.device_cache`): OrtValues in the execution provider's memory,
run with IO binding; `StaticCache` (`tfserve.runtime.static_cache`): the device placement
with fixed buffers per bucket.

Each counts its ONNX Runtime runs and the bytes it moves between host and device memory
(`RunCounters`, `tfserve.runtime.ort_runs`), which `python -m tfserve.bench.step_profile
--search` reports per step. `Runtime` picks one at construction and hands it every cache
operation and every run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.runtime.ort_runs import RunCounters, host_run
from tfserve.step import SampleDraws, StepOutput, narrow_first
from tfserve.step.threads import numpy_pool

POOL_MIN_BYTES = 4 << 20  # cache row operations below this total size run on one thread


@dataclass(frozen=True)
class DecoderNames:
    """The decoder's input and output names a step binds: the past and cross K/V inputs,
    the outputs (the logits, then the present K/V), and the top candidates' outputs (empty
    where the graph has none)."""

    past: tuple[str, ...]
    cross: tuple[str, ...]
    outputs: tuple[str, ...]
    top_outputs: tuple[str, ...]


class CacheStorage(ABC):
    """The runs of the two graphs and the `generation.Backend` cache row operations, for
    one placement of the cache. A cache is a list of 2L tensors [B,H,P,Dh]."""

    # whether `run_decoder` takes draws and makes them where the step's logits are, so that
    # no row of them comes to the host (Runtime.draws_in_step): the device placements'. On
    # the host there is no boundary to spare: the searches draw from the numpy rows
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
    def run_decoder(self, decoder: ort.InferenceSession, names: DecoderNames,
                    feeds: dict[str, np.ndarray], past: Any, cross: Any,
                    need_logits: bool = True, parents: np.ndarray | None = None,
                    draws: SampleDraws | None = None) -> StepOutput:
        """One decoder step (the step contract, `tfserve.step.Backend.step`): feeds are the
        host inputs (ids, positions, masks); the logits are fetched only when need_logits,
        the top candidates always; parents [B]: row i continues row parents[i] of `past`
        (None: its own); draws: made where the logits are (`draws_on_device` only)."""

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
        hidden, *cross = host_run(encoder, self.counters, outputs, feeds)
        return hidden, cross

    def run_decoder(self, decoder: ort.InferenceSession, names: DecoderNames,
                    feeds: dict[str, np.ndarray], past: Any, cross: Any,
                    need_logits: bool = True, parents: np.ndarray | None = None,
                    draws: SampleDraws | None = None) -> StepOutput:
        if draws is not None:
            raise ValueError("the host placement makes no draws: its searches draw from the "
                             "numpy rows (draws_on_device is False)")
        if parents is not None:  # a gather of every row: the caller's past stays as it is
            past = self.take_rows(past, parents)
        feeds = dict(feeds)
        feeds.update(zip(names.past, past))
        feeds.update(zip(names.cross, cross))
        outputs = list(names.outputs if need_logits else names.outputs[1:])
        fetched = host_run(decoder, self.counters, outputs + list(names.top_outputs), feeds)
        logits = fetched.pop(0).astype(np.float32, copy=False) if need_logits else None
        cache_end = len(names.outputs) - 1
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
