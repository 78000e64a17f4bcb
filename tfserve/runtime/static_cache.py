"""The static KV cache: preallocated buffers per bucket, each step replayable at fixed shapes.

`StaticCache` is the device placement (`DeviceCache`: OrtValues, IO binding) with the
self-attention cache kept in fixed buffers instead of a tensor per step: per layer a key and
a value buffer [R,H,L,Dh] (the bucket: R rows, L columns), and the decoder graph rewritten to
gather its rows, scatter the step's column and attend over the whole buffer
(`tfserve.runtime.static_step`).

What the search holds is a `StaticPast`: which buffer row each of its rows continues. The
`generation.Backend` row operations become bookkeeping on those indices, and no ONNX
Runtime run: a beam reorder, rows leaving (finished, cancelled) and a compaction name other
rows; a row joining names none (it starts at position 0, where only the column it writes is
valid); padding and slicing the time axis change nothing (a row's history is the first
`position` columns of its buffer row). The next step's one run does the gather.

The cross K/V live in fixed buffers too, per layer [Rc,H,Sc,Dh]: one row per source (a
slot; a beam search's rows share their sentence's, as the grouped cross-attention of graph
revision 5 takes them), Sc a source-length bucket. A source's rows are written into a free
slot when it joins (`static_step.cross_write_graph`: the encoder's output right-padded with
zeros, in place) and stay there until it leaves; what the search holds is a `StaticCross`,
the slot of each of its sources, so that leaving, cutting the time axis and repeating rows
per decoder row are bookkeeping too. Columns past a source's length are masked by the
`encoder_attention_mask` input, kept at [Rc,Sc].

A step runs at its bucket's shapes whatever the batch's row count n: R = Rc x G rows, G the
most rows any source has (a beam search's beams; it only grows while the batch keeps the
bucket). Row i of the batch runs as decoder row slot x G + (its rank among its source's
rows), which the grouped cross-attention maps to its source's cross row (decoder row b
reads cross row b // G); the other rows are padding: token 0 at position 0 reading buffer
row 0 and its column 0, written to a buffer row no row continues, with their results
ignored: no op of the step mixes rows, so padding changes no real row's result beyond the
rounding of kernels batched over more rows. A source slot no row uses has a mask of one
valid column (no softmax over nothing). Each bucket's small inputs
(`input_ids`, `position_ids`, `cache_rows`, `encoder_attention_mask`) and outputs (logits,
top candidates, present K/V) are OrtValues made once; a step copies the inputs into them
(`OrtValue.update_inplace`; the mask only when it changed) and runs one of the bucket's two
IO bindings (`Replay`: one per buffer set it reads), which are bound once. Only the top
candidates cross to the host (and the logits when the step is asked for them).

Two buffer sets per bucket, swapped at each step: a step reads one and writes the other, so
a failed run leaves the batch's cache as it was (`DecodeBatch`'s promise), and a step on
rows taken without `reuse` (`DecodeBatch.run_alone`) writes a pair of its own. Their
addresses stay fixed while the bucket does, and so do the two bindings: a replayed step (a
CUDA graph captured per binding) sees the same shapes and addresses every time. A batch that
outgrows its bucket moves to the next one (sources: powers of two from `SOURCES`; columns:
doubled from `LENGTH` up to the model's max_target_positions; source columns doubled from
`SOURCE_LENGTH`; G: from `GROUP` up to the most rows of a source): the growing step gathers
from the old buffers into the new ones through a binding of its own (a longer bucket first
pads the old ones: one pad run, once per bucket), and a join that outgrows the cross buffers
copies them into bigger ones, each source at its slot. Buffers no search holds any more go
back to small pools and serve the next batch.

A graph whose outputs have a dimension other than the batch that is not fixed, or that takes
cross K/V one row per decoder row (before graph revision 5), is refused.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.runtime.cache import DecoderNames
from tfserve.runtime.device_cache import DeviceCache
from tfserve.runtime.ort_runs import (
    bound_run,
    float_element,
    run_kept_binding,
    small_session,
)
from tfserve.runtime.static_buffers import (
    ENCODER_ATTENTION_MASK,
    ROW_INPUTS,
    Buffers,
    CrossBuffers,
    Replay,
    StaticCross,
    StaticPast,
    columns,
    rank_within,
)
from tfserve.runtime.static_step import (
    CROSS_PADS,
    CROSS_ROWS,
    SELF_ATTENTION_MASK,
    cross_write_graph,
)
from tfserve.step import SampleDraws, StepOutput, narrow_first

__all__ = ["StaticCache", "StaticCross", "StaticPast"]


class StaticCache(DeviceCache):
    """The device placement with the self-attention and cross K/V in static buffers and each
    bucket's step bound once (module docstring). The decoder it runs is
    `static_step.static_decoder`'s rewrite."""

    SOURCES = 1  # the smallest bucket's sources (cross rows); the next ones double
    GROUP = 1  # the fewest decoder rows per source a bucket has; grows to the most a source has
    LENGTH = 32  # the smallest bucket's columns; the next ones double up to max_length
    SOURCE_LENGTH = 32  # the smallest cross bucket's columns; the next ones double
    POOL = 2  # buffer pairs (and cross buffers) kept for the next batch once none is held

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
        grouped_cross: bool = True,
    ) -> None:
        """max_length: the longest bucket (model.max_target_positions: a row's position
        never reaches it). grouped_cross: the decoder takes cross K/V with one row per
        group of rows (graph revision 5 and later), which the fixed cross buffers need."""
        if not grouped_cross:
            raise ValueError("the static KV cache needs a decoder that takes cross K/V one row "
                             "per source (graph revision 5 or later): export the model again")
        super().__init__(tensors, heads, head_dim, dtype, memory, index, providers)
        self.max_length = max_length
        self.providers = providers
        # freed buffer pairs and cross buffers, oldest first, with their (rows, columns); a
        # pair is released by the garbage collector on whatever thread drops the last
        # StaticPast (or StaticCross) of it
        self._pool: list[tuple[tuple[int, int], list[list[ort.OrtValue]]]] = []
        self._cross_pool: list[tuple[tuple[int, int], list[ort.OrtValue]]] = []
        self._pool_lock = threading.RLock()
        self._cross_writer: ort.InferenceSession | None = None
        self.buckets_made = 0  # buffer pairs allocated (not taken from the pool)
        self.cross_buckets_made = 0  # cross buffers allocated

    # -- buffers ----------------------------------------------------------------------------

    def _length_bucket(self, length: int) -> int:
        """The bucket's columns for a row that needs `length` of them."""
        if length > self.max_length:
            raise ValueError(
                f"the static KV cache holds {self.max_length} positions "
                f"(model.max_target_positions); a row needs {length}"
            )
        # doubled from LENGTH, the last bucket cut to max_length
        return min(self._doubled(min(self.LENGTH, self.max_length), length), self.max_length)

    @staticmethod
    def _doubled(first: int, size: int) -> int:
        """The smallest first x 2^k >= size."""
        bucket = max(first, 1)
        while bucket < size:
            bucket *= 2
        return bucket

    def _zeros(self, shape: tuple[int, ...]) -> ort.OrtValue:
        """A new buffer of zeros (a masked column is multiplied by a weight of 0, which NaN
        garbage would survive)."""
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.dtype), self.memory,
                                                self.index)

    def _pooled(self, pool: list[Any], shape: tuple[int, int]) -> Any:
        """What `pool` keeps for buffers of `shape` (rows, columns), taken out of it (None:
        nothing)."""
        with self._pool_lock:
            position = next((i for i, (kept, _) in enumerate(pool) if kept == shape), None)
            return pool.pop(position)[1] if position is not None else None

    def _take(self, rows: int, length: int, group: int) -> Buffers:
        """A pair of buffer sets [R,H,L,Dh] from the pool, or new ones."""
        sets = self._pooled(self._pool, (rows, length))
        if sets is None:
            self.buckets_made += 1
            shape = (rows, self.heads, length, self.head_dim)  # [R,H,L,Dh]
            sets = [[self._zeros(shape) for _ in range(self.tensors)] for _ in range(2)]
        buffers = Buffers(sets, rows, length, group)
        weakref.finalize(buffers, self._release, self._pool, sets, (rows, length))
        return buffers

    def _take_cross(self, rows: int, length: int) -> CrossBuffers:
        """Cross buffers [Rc,H,Sc,Dh] from the pool, or new ones."""
        values = self._pooled(self._cross_pool, (rows, length))
        if values is None:
            self.cross_buckets_made += 1
            shape = (rows, self.heads, length, self.head_dim)  # [Rc,H,Sc,Dh]
            values = [self._zeros(shape) for _ in range(self.tensors)]
        buffers = CrossBuffers(values, rows, length)
        weakref.finalize(buffers, self._release, self._cross_pool, values, (rows, length))
        return buffers

    def _release(self, pool: list, values: Any, shape: tuple[int, int]) -> None:
        """Buffers no `StaticPast` (or `StaticCross`) refers to any more: kept for the next
        batch."""
        with self._pool_lock:
            pool.append((shape, values))
            if len(pool) > self.POOL:
                del pool[0]

    def drop_pool(self) -> None:
        """Free the pooled buffers (the load's check steps at the last target position, in
        a bucket of model.max_target_positions columns that serving rarely needs)."""
        with self._pool_lock:
            self._pool.clear()
            self._cross_pool.clear()

    # -- the cross K/V ----------------------------------------------------------------------

    def _write_cross(self, buffers: CrossBuffers, rows: np.ndarray,
                     part: Sequence[Any]) -> None:
        """Write `part` (2L tensors [N,H,S,Dh], S <= Sc) into slots `rows` [N] of `buffers`,
        in place (one run of `static_step.cross_write_graph`)."""
        if not len(rows):
            return
        if self._cross_writer is None:
            self._cross_writer = small_session(
                cross_write_graph(self.tensors, float_element(self.dtype)), self.providers)
        part = [self._device_value(value) for value in part]
        pads = np.zeros(8, np.int64)  # [b0,h0,t0,d0, b1,h1,t1,d1]: zeros after the columns
        pads[6] = buffers.length - part[0].shape()[2]
        inputs = {}
        for i, (buffer, value) in enumerate(zip(buffers.values, part)):
            inputs[f"buffer_{i}"] = buffer  # [Rc,H,Sc,Dh]
            inputs[f"part_{i}"] = value  # [N,H,S,Dh]
        bound_run(self._cross_writer, self.counters,
                  host_inputs={CROSS_ROWS: np.asarray(rows, np.int64).reshape(-1, 1),  # [N,1]
                               CROSS_PADS: pads},
                  inputs=inputs,
                  # in place: each buffer keeps its address
                  outputs=[(f"out_{i}", buffer) for i, buffer in enumerate(buffers.values)])
        buffers.writes += 1
        buffers.written[rows] = buffers.writes

    def _join_cross(self, running: StaticCross | None, kept: np.ndarray,
                    parts: Sequence[Sequence[Any]], length: int) -> StaticCross:
        """The cross K/V of `running`'s sources `kept` (slot indices, in order) and of the
        new sources of `parts` (2L tensors [N,H,S,Dh] each, in order) in fixed buffers: the
        new ones written into free slots, the buffers grown first (every slot copied to
        the same slot of bigger ones) when they lack slots or columns."""
        counts = [part[0].shape()[0] if isinstance(part[0], ort.OrtValue) else len(part[0])
                  for part in parts]
        longest = max([length, *(columns(part[0]) for part in parts)])
        buffers = running.buffers if running is not None else None
        sources = len(np.unique(kept)) + sum(counts)
        if buffers is None or buffers.rows < sources or buffers.length < longest:
            grown = self._take_cross(
                self._doubled(self.SOURCES, max(sources, buffers.rows if buffers else 0)),
                self._doubled(self.SOURCE_LENGTH, max(longest, buffers.length if buffers
                                                      else 0)))
            if buffers is not None:  # every slot where it was: `kept` stays valid
                self._write_cross(grown, np.arange(buffers.rows), buffers.values)
            buffers = grown
        free = np.setdiff1d(np.arange(buffers.rows), kept)[: sum(counts)]  # [N] in order
        start = 0
        for part, count in zip(parts, counts):
            self._write_cross(buffers, free[start : start + count], part)
            start += count
        return StaticCross(buffers, np.concatenate([kept, free]).astype(np.int64),
                           buffers.writes)

    def _static_cross(self, cross: Sequence[Any] | StaticCross) -> StaticCross:
        """Cross K/V as a `StaticCross` (the encoder's tensors written into buffers of
        their own: a step given them straight from `encode`)."""
        if isinstance(cross, StaticCross):
            return cross
        return self._join_cross(None, np.zeros(0, np.int64), [cross], 0)

    # -- the step ---------------------------------------------------------------------------

    def run_decoder(self, decoder: ort.InferenceSession, names: DecoderNames,
                    feeds: dict[str, np.ndarray], past: Any, cross: Any,
                    need_logits: bool = True, parents: np.ndarray | None = None,
                    draws: SampleDraws | None = None) -> StepOutput:
        """The bucket's bound step (module docstring); `parents` are bookkeeping on the
        rows the StaticPast names, and `draws` a run of the standalone draw graph on the
        bucket's logits (the static rewrite has no draw of its own)."""
        if not isinstance(past, StaticPast):
            raise TypeError(
                "the static KV cache steps the past its own steps made "
                "(empty_past, a step's present), not tensors"
            )
        if parents is not None:  # the run gathers the rows the StaticPast names
            past = self.take_rows(past, parents, reuse=True)
        positions = feeds["position_ids"]  # [n,1]
        rows = len(past.rows)
        if positions.shape != (rows, 1):
            raise ValueError(
                f"the static KV cache steps one new token per row: position_ids "
                f"{list(positions.shape)} for {rows} rows"
            )
        unknown = set(feeds) - {*ROW_INPUTS, ENCODER_ATTENTION_MASK, SELF_ATTENTION_MASK}
        if unknown:
            raise ValueError(f"the static KV cache's step takes no input {min(unknown)!r}")
        source = past.buffers
        if source is not None and past.generation != source.generation:
            raise ValueError(
                "this static KV cache was overwritten by a later step: step the "
                "present of the latest step"
            )
        static_cross = self._static_cross(cross)  # type: ignore[arg-type]
        if not static_cross.current():
            raise ValueError("these cross K/V's slots were given to other sources since")
        encoder_mask = feeds[ENCODER_ATTENTION_MASK]  # [M,S]
        sources = len(static_cross.rows)
        cross_buffers = static_cross.buffers
        if not sources or rows % sources or encoder_mask.shape[0] != sources:
            raise ValueError(
                f"the static KV cache steps rows in groups of one source each: {rows} rows, "
                f"{sources} cross rows, an encoder_attention_mask of {encoder_mask.shape[0]}"
            )
        if encoder_mask.shape[1] > cross_buffers.length:
            raise ValueError(f"encoder_attention_mask has {encoder_mask.shape[1]} columns; the "
                             f"cross K/V have {cross_buffers.length}")
        # row i's source slot, and its rank among that slot's rows: its decoder row is
        # slot x G + rank, which the grouped cross-attention maps to the slot (b // G)
        slot = static_cross.rows[np.arange(rows) // (rows // sources)]  # [n]
        rank = rank_within(slot)  # [n]
        group = max(int(rank.max()) + 1, self.GROUP, source.group if source else 1)
        bucket_rows = cross_buffers.rows * group  # R
        place = slot * group + rank  # [n] the decoder row of each row
        # the step writes column `position` of each row: the bucket must hold it
        need = int(positions.max()) + 1
        target = source
        read = None if source is None else source.sets[source.current]
        if source is None or source.rows != bucket_rows or source.length < need:
            length = self._length_bucket(max(need, source.length if source else 0))
            target = self._take(bucket_rows, length, group)
            if source is not None and source.length < target.length:
                read = self.ops.pad_time(read, target.length - source.length, left=False)
        elif past.scratch:  # the batch's own cache stays as it is: write a pair of our own
            target = self._take(source.rows, source.length, group)
        replay = target.replay
        if replay is None or replay.cross is not cross_buffers or replay.decoder is not decoder:
            replay = target.replay = Replay(self.device, decoder, target, cross_buffers, names)
        if read is None or read is target.sets[target.current]:  # the bucket's own binding
            binding = replay.bindings[target.current]
        else:  # the first step of a bucket reads the old one's buffers (or padded copies)
            binding = replay.bind(read, target.sets[1 - target.current])
        self.counters.to_device += replay.copy_inputs(feeds, np.maximum(past.rows, 0), place,
                                                     static_cross)
        run_kept_binding(decoder, binding, self.counters)
        # the written set is the cache now: the run is done, and a failed one changed nothing
        target.current = 1 - target.current
        target.generation += 1
        present = StaticPast(target, place.astype(np.int64), target.generation)
        tops = [self._fetch_rows(replay.outputs[name], place) for name in names.top_outputs]
        drawn: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        if draws is not None:  # from the bucket's [R,1,V]: each draw's row at its decoder row
            drawn = self.sampler.draw(replay.outputs[names.outputs[0]], draws._replace(
                rows=place[np.asarray(draws.rows, np.int64)]))
        logits = None
        if need_logits:  # [n,1,V]
            logits = self._fetch_rows(replay.outputs[names.outputs[0]], place)
            logits = logits.astype(np.float32, copy=False)
        return StepOutput(logits, present, *tops, *drawn)

    def _fetch_rows(self, value: ort.OrtValue, place: np.ndarray) -> np.ndarray:
        """Rows `place` of an output [R,...] as numpy (all R rows cross to the host)."""
        # on CPU a view of the bound value, on a device a copy; [n,...] rows taken: a copy
        return self._fetch(value)[place]

    # -- rows: bookkeeping on the indices, no run --------------------------------------------

    def empty_past(self, rows: int) -> Any:
        return StaticPast(None, np.full(rows, -1, np.int64))

    def take_rows(self, cache: Any, index: np.ndarray, reuse: bool = False) -> Any:
        if isinstance(cache, StaticCross):
            return StaticCross(cache.buffers, cache.rows[np.asarray(index, np.int64)],
                               cache.writes)
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
            return self._concat_cross(caches, length, first_rows, first_time)
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

    def _concat_cross(self, caches: Sequence[Any], length: int | None,
                      first_rows: np.ndarray | None, first_time: tuple[int, int] | None
                      ) -> StaticCross:
        """Cross K/V joining (a batch's `StaticCross` first, if it has one, then the
        encoder's tensors of the newcomers): the newcomers written into free slots."""
        running = caches[0] if isinstance(caches[0], StaticCross) else None
        parts = list(caches[1:] if running is not None else caches)
        if any(isinstance(part, StaticCross) for part in parts):
            raise TypeError("static cross K/V join the encoder's outputs, not other ones")
        if running is None:
            kept = np.zeros(0, np.int64)
            if first_rows is not None or first_time is not None:
                parts = narrow_first(self, parts, first_rows, first_time)
        else:  # the time axis is the bucket's: first_time changes nothing
            kept = running.rows if first_rows is None else running.rows[first_rows]
        return self._join_cross(running, kept, parts, length or 0)

    def pad_time(self, cache: Any, length: int, left: bool) -> Any:
        if isinstance(cache, (StaticPast, StaticCross)):
            return cache
        if not left:  # the encoder's cross K/V joining an empty batch
            return self._join_cross(None, np.zeros(0, np.int64), [cache], length)
        return super().pad_time(cache, length, left)

    def slice_time(self, cache: Any, start: int, stop: int) -> Any:
        if isinstance(cache, (StaticPast, StaticCross)):
            return cache
        return super().slice_time(cache, start, stop)
