"""The static KV cache: preallocated buffers per bucket, each step writing one column in place.

`StaticCache` is the device placement (`DeviceCache`: OrtValues, IO binding, the cross K/V
and their row graphs as there) with the self-attention cache kept in fixed buffers instead
of a tensor per step: per layer a key and a value buffer [R,H,L,Dh] (the bucket: R rows, L
columns), and the decoder graph rewritten to gather its rows, scatter the step's column and
attend over the whole buffer (`tfserve.runtime.static_step`).

What the search holds is a `StaticPast`: which buffer row each of its rows continues. The
`generation.Backend` row operations become bookkeeping on those indices, and no ONNX
Runtime run: a beam reorder, rows leaving (finished, cancelled) and a compaction name other
rows; a row joining names none (it starts at position 0, where only the column it writes is
valid); padding and slicing the time axis change nothing (a row's history is the first
`position` columns of its buffer row). The next step's one run does the gather.

Two buffer sets per bucket, swapped at each step: a step reads one and writes the other, so
a failed run leaves the batch's cache as it was (`DecodeBatch`'s promise), and a step on
rows taken without `reuse` (`DecodeBatch.run_alone`) writes the set that the next step
overwrites anyway. Their addresses stay fixed while the bucket does. A batch that outgrows
its bucket moves to the next one (rows: powers of two from `ROWS`; columns: doubled from
`LENGTH` up to the model's max_target_positions): the growing step gathers from the old
buffers into the new ones (a longer bucket first pads the old ones: one pad run, once per
bucket). Buffers no search holds any more go back to a small pool and serve the next batch.

What is not static yet (the CUDA-graph issue): the step's shapes follow the batch's row
count n <= R (its outputs are bound to the first n rows of the buffers); the cross K/V stay
per member as on the device placement (made at a join, cut when members leave).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.generation import StepOutput
from tfserve.runtime.cache import DeviceCache
from tfserve.runtime.static_step import SELF_ATTENTION_MASK
from tfserve.runtime.step_graph import CACHE_ROWS


class _Buffers:
    """One bucket's two buffer sets, 2L OrtValues [R,H,L,Dh] each; `current` holds the
    cache, the other is written by the next step. `generation` counts the swaps: a
    `StaticPast` of an older generation names rows that were overwritten since."""

    def __init__(self, sets: list[list[ort.OrtValue]], rows: int, length: int) -> None:
        self.sets = sets
        self.rows, self.length = rows, length
        self.current = 0
        self.generation = 0


@dataclass(frozen=True, eq=False)
class StaticPast:
    """A static cache as a search holds it: row i continues row `rows[i]` of `buffers`' current
    set (-1: a row without history, which reads nothing). `buffers` None: no row has history
    (`empty_past`). `scratch`: taken without reuse, so a step on it must leave the current
    set as it is (the step writes the other set and does not swap)."""

    buffers: _Buffers | None
    rows: np.ndarray  # int64 [n]
    generation: int = 0
    scratch: bool = False


class StaticCache(DeviceCache):
    """The device placement with the self-attention cache in static buffers (module
    docstring). The decoder it runs is `static_step.static_decoder`'s rewrite."""

    ROWS = 8  # the smallest bucket's rows; the next ones double
    LENGTH = 32  # the smallest bucket's columns; the next ones double up to max_length
    POOL = 2  # buffer pairs kept for the next batch once no search holds them

    def __init__(
        self,
        tensors: int,
        heads: int,
        head_dim: int,
        dtype: type[np.floating],
        memory: str,
        index: int,
        providers: list[Any],
        max_length: int,
    ) -> None:
        """max_length: the longest bucket (model.max_target_positions: a row's position
        never reaches it)."""
        super().__init__(tensors, heads, head_dim, dtype, memory, index, providers)
        self.max_length = max_length
        # free pairs, newest last, and their (rows, columns); a pair is released by the
        # garbage collector on whatever thread drops the last StaticPast of it
        # freed buffer pairs, oldest first, with their (rows, columns)
        self._pool: list[tuple[tuple[int, int], list[list[ort.OrtValue]]]] = []
        self._pool_lock = threading.RLock()
        self.buckets_made = 0  # buffer pairs allocated (not taken from the pool)

    # -- buffers ----------------------------------------------------------------------------

    def _bucket(self, rows: int, length: int) -> tuple[int, int]:
        """The bucket (rows, columns) for `rows` rows of `length` columns."""
        if length > self.max_length:
            raise ValueError(
                f"the static KV cache holds {self.max_length} positions "
                f"(model.max_target_positions); a row needs {length}"
            )
        bucket_rows, bucket_length = self.ROWS, min(self.LENGTH, self.max_length)
        while bucket_rows < rows:
            bucket_rows *= 2
        while bucket_length < length:
            bucket_length = min(bucket_length * 2, self.max_length)
        return bucket_rows, bucket_length

    def _take(self, rows: int, length: int) -> _Buffers:
        """A pair of buffer sets [R,H,L,Dh] from the pool, or new ones (zeros: a masked column
        is multiplied by a weight of 0, which NaN garbage would survive)."""
        shape = (rows, self.heads, length, self.head_dim)
        with self._pool_lock:
            position = next((i for i, (shape, _) in enumerate(self._pool)
                             if shape == (rows, length)), None)
            pooled = position is not None
            if pooled:
                sets = self._pool.pop(position)[1]
        if not pooled:
            self.buckets_made += 1
            zeros = np.zeros(shape, self.dtype)
            sets = [
                [
                    ort.OrtValue.ortvalue_from_numpy(
                        zeros.copy() if self.memory == "cpu" else zeros, self.memory, self.index
                    )
                    for _ in range(self.tensors)
                ]
                for _ in range(2)
            ]
        buffers = _Buffers(sets, rows, length)
        weakref.finalize(buffers, self._release, sets, (rows, length))
        return buffers

    def _release(self, sets: list[list[ort.OrtValue]], shape: tuple[int, int]) -> None:
        """Buffers no `StaticPast` refers to any more: kept for the next batch."""
        with self._pool_lock:
            self._pool.append((shape, sets))
            if len(self._pool) > self.POOL:
                del self._pool[0]

    def drop_pool(self) -> None:
        """Free the pooled buffers (the load's check steps at the last target position, in
        a bucket of model.max_target_positions columns that serving rarely needs)."""
        with self._pool_lock:
            self._pool.clear()

    # -- the step ---------------------------------------------------------------------------

    def run_decoder(
        self,
        decoder: ort.InferenceSession,
        feeds: dict[str, np.ndarray],
        past_names: list[str],
        past: Sequence[Any],
        cross_names: list[str],
        cross: Sequence[Any],
        outputs: list[str],
        top_outputs: list[str],
        need_logits: bool = True,
    ) -> StepOutput:
        if not isinstance(past, StaticPast):
            raise TypeError(
                "the static KV cache steps the past its own steps made "
                "(empty_past, a step's present), not tensors"
            )
        positions = feeds["position_ids"]  # [n,1]
        rows = len(past.rows)
        if positions.shape != (rows, 1):
            raise ValueError(
                f"the static KV cache steps one new token per row: position_ids "
                f"{list(positions.shape)} for {rows} rows"
            )
        source = past.buffers
        if source is not None and past.generation != source.generation:
            raise ValueError(
                "this static KV cache was overwritten by a later step: step the "
                "present of the latest step"
            )
        # the step writes column `position` of each row: the bucket must hold it
        need = int(positions.max()) + 1 if rows else 1
        target = source
        read = None if source is None else source.sets[source.current]
        if source is None or source.rows < rows or source.length < need:
            target = self._take(
                *self._bucket(
                    max(rows, source.rows if source else 0),
                    max(need, source.length if source else 0),
                )
            )
            if source is not None and source.length < target.length:
                read = self.ops.pad_time(read, target.length - source.length, left=False)
        elif past.scratch:  # the batch's own cache stays as it is: write a pair of our own
            target = self._take(source.rows, source.length)
        if read is None:  # no row has history: any buffer of the right length will do
            read = target.sets[target.current]
        write = target.sets[1 - target.current]  # never the set it reads
        small = {name: value for name, value in feeds.items() if name != SELF_ATTENTION_MASK}
        small[CACHE_ROWS] = np.maximum(past.rows, 0).astype(np.int64)  # newcomers: any row
        binding = self._binding(decoder)
        self._bind_host_inputs(binding, small)
        for name, value in zip(past_names, read):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(cross_names, cross):
            binding.bind_ortvalue_input(name, self._device_value(value))
        shape = [rows, self.heads, target.length, self.head_dim]  # the first rows of `write`

        def bind_present(names: list[str]) -> None:  # into the set it writes, in place
            for name, value in zip(names, write):
                binding.bind_output(name, self.memory, self.index, self.dtype, shape,
                                    value.data_ptr())

        logits, _, tops = self._run_step(decoder, binding, outputs, top_outputs, need_logits,
                                         bind_present)
        # the written set is the cache now: the run is done, and a failed one changed nothing
        target.current = 1 - target.current
        target.generation += 1
        present = StaticPast(target, np.arange(rows, dtype=np.int64), target.generation)
        return StepOutput(logits, present, *tops)

    # -- rows: bookkeeping on the indices, no run --------------------------------------------

    def empty_past(self, rows: int) -> Any:
        return StaticPast(None, np.full(rows, -1, np.int64))

    def take_rows(self, cache: Any, index: np.ndarray, reuse: bool = False) -> Any:
        if not isinstance(cache, StaticPast):
            return super().take_rows(cache, index, reuse)
        return StaticPast(
            cache.buffers,
            cache.rows[np.asarray(index, np.int64)],
            cache.generation,
            cache.scratch or not reuse,
        )

    def concat_rows(
        self,
        caches: Sequence[Any],
        length: int | None = None,
        left: bool = False,
        first_rows: np.ndarray | None = None,
        first_time: tuple[int, int] | None = None,
    ) -> Any:
        if not any(isinstance(cache, StaticPast) for cache in caches):
            return super().concat_rows(caches, length, left, first_rows, first_time)
        if not all(isinstance(cache, StaticPast) for cache in caches):
            raise TypeError("a static KV cache joins static ones only")
        held = {id(cache.buffers): cache for cache in caches if cache.buffers is not None}
        if len(held) > 1:
            raise ValueError("rows of two static KV caches cannot share a batch")
        first = caches[0].rows if first_rows is None else caches[0].rows[first_rows]
        owner = next(iter(held.values()), caches[0])
        # the time axis is the bucket's: first_time, length and left change nothing
        return StaticPast(
            owner.buffers,
            np.concatenate([first, *(c.rows for c in caches[1:])]),
            owner.generation,
            any(cache.scratch for cache in caches),
        )

    def pad_time(self, cache: Any, length: int, left: bool) -> Any:
        if not isinstance(cache, StaticPast):
            return super().pad_time(cache, length, left)
        return cache

    def slice_time(self, cache: Any, start: int, stop: int) -> Any:
        if not isinstance(cache, StaticPast):
            return super().slice_time(cache, start, stop)
        return cache
