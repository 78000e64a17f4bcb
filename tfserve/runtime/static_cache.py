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
IO bindings (`_Replay`: one per buffer set it reads), which are bound once. Only the top
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.generation import StepOutput, narrow_first
from tfserve.runtime.cache import DeviceCache
from tfserve.runtime.static_step import (
    CROSS_PADS,
    CROSS_ROWS,
    SELF_ATTENTION_MASK,
    cross_write_graph,
)
from tfserve.runtime.step_graph import CACHE_ROWS

ENCODER_ATTENTION_MASK = "encoder_attention_mask"
# the step's inputs with one row per decoder row, [R,1] or [R]; padding rows read 0
ROW_INPUTS = ("input_ids", "position_ids", CACHE_ROWS)
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32}


class _Buffers:
    """One bucket's two buffer sets, 2L OrtValues [R,H,L,Dh] each; `current` holds the
    cache, the other is written by the next step. `generation` counts the swaps: a
    `StaticPast` of an older generation names rows that were overwritten since. `group`:
    the decoder rows per source slot (R = slots x group). `replay`: the bucket's bound step,
    made at its first step."""

    def __init__(self, sets: list[list[ort.OrtValue]], rows: int, length: int,
                 group: int = 1) -> None:
        self.sets = sets
        self.rows, self.length, self.group = rows, length, group
        self.current = 0
        self.generation = 0
        self.replay: _Replay | None = None


class _CrossBuffers:
    """One cross bucket: 2L OrtValues [Rc,H,Sc,Dh], a row (slot) per source. `writes` counts
    the write runs; `written[s]` is the count at slot s's last write, so a `StaticCross` made
    before it knows that its slot holds another source now."""

    def __init__(self, values: list[ort.OrtValue], rows: int, length: int) -> None:
        self.values = values
        self.rows, self.length = rows, length
        self.writes = 0
        self.written = np.zeros(rows, np.int64)  # [Rc]


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


@dataclass(frozen=True, eq=False)
class StaticCross:
    """Cross K/V as a search holds them: source i is row (slot) `rows[i]` of `buffers`; a
    slot repeated is a source whose rows each take it (the per-row layout). `writes`:
    `buffers.writes` when it was made."""

    buffers: _CrossBuffers
    rows: np.ndarray  # int64 [M]
    writes: int

    def current(self) -> bool:
        """Whether every slot still holds the source it held when this was made."""
        return not len(self.rows) or int(self.buffers.written[self.rows].max()) <= self.writes


class _Replay:
    """A bucket's step bound once: the small inputs and the outputs as OrtValues made here
    (inputs [R,1], [R] and [Rc,Sc], copied into each step; logits [R,1,V], top candidates
    [R,1,K]), and two IO bindings, `bindings[s]` reading buffer set s and writing the other,
    with the cross buffers. `bind` makes a binding of the same values for a step that reads
    other buffers (a bucket's first step, after growing)."""

    def __init__(self, storage: StaticCache, decoder: ort.InferenceSession,
                 target: _Buffers, cross: _CrossBuffers, names: _StepNames) -> None:
        self.decoder, self.cross, self.names = decoder, cross, names
        rows = target.rows
        memory, index = storage.memory, storage.index
        # host copies of the inputs, [R,1] and [R]: written here, then copied to the device
        self.host = {
            "input_ids": np.zeros((rows, 1), np.int64),  # [R,1]
            "position_ids": np.zeros((rows, 1), np.int64),  # [R,1]
            CACHE_ROWS: np.zeros(rows, np.int64),  # [R]
            ENCODER_ATTENTION_MASK: np.zeros((cross.rows, cross.length), np.int64),  # [Rc,Sc]
        }
        self.inputs = {
            name: ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, memory,
                                                            index)
            for name, array in self.host.items()
        }
        self.mask_sent: np.ndarray | None = None  # the mask the device holds
        outputs = {value.name: value for value in decoder.get_outputs()}
        self.outputs = {}
        for name in [names.outputs[0], *names.top_outputs]:  # [R,1,V], [R,1,K]
            declared = outputs[name]
            if not all(isinstance(dim, int) for dim in declared.shape[2:]):
                raise ValueError(f"the static KV cache binds {name!r} at fixed shapes; the "
                                 f"decoder declares it {declared.shape}")
            shape = [rows, 1, *declared.shape[2:]]
            self.outputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, _NUMPY_TYPES[declared.type], memory, index)
        self.bindings = [self.bind(target.sets[s], target.sets[1 - s]) for s in (0, 1)]

    def bind(self, read: Sequence[ort.OrtValue], write: Sequence[ort.OrtValue]
             ) -> ort.IOBinding:
        """An IO binding of this step reading the self-attention buffers `read`, writing
        `write` ([R,H,L,Dh] each, in place) and the outputs into this replay's values."""
        names = self.names
        binding = self.decoder.io_binding()
        for name, value in self.inputs.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(names.past, read):  # [R',H,L,Dh]
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(names.cross, self.cross.values):  # [Rc,H,Sc,Dh]
            binding.bind_ortvalue_input(name, value)
        for name, value in self.outputs.items():
            binding.bind_ortvalue_output(name, value)
        for name, value in zip(names.outputs[1:], write):  # [R,H,L,Dh]
            binding.bind_ortvalue_output(name, value)
        return binding


@dataclass(frozen=True)
class _StepNames:
    """The decoder's input and output names a step binds."""

    past: tuple[str, ...]
    cross: tuple[str, ...]
    outputs: tuple[str, ...]  # logits, then the present K/V
    top_outputs: tuple[str, ...]


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
        self._step_place: np.ndarray | None = None  # [n] the kept logits' row of each row

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

    def _take(self, rows: int, length: int, group: int) -> _Buffers:
        """A pair of buffer sets [R,H,L,Dh] from the pool, or new ones."""
        sets = self._pooled(self._pool, (rows, length))
        if sets is None:
            self.buckets_made += 1
            shape = (rows, self.heads, length, self.head_dim)  # [R,H,L,Dh]
            sets = [[self._zeros(shape) for _ in range(self.tensors)] for _ in range(2)]
        buffers = _Buffers(sets, rows, length, group)
        weakref.finalize(buffers, self._release, self._pool, sets, (rows, length))
        return buffers

    def _take_cross(self, rows: int, length: int) -> _CrossBuffers:
        """Cross buffers [Rc,H,Sc,Dh] from the pool, or new ones."""
        values = self._pooled(self._cross_pool, (rows, length))
        if values is None:
            self.cross_buckets_made += 1
            shape = (rows, self.heads, length, self.head_dim)  # [Rc,H,Sc,Dh]
            values = [self._zeros(shape) for _ in range(self.tensors)]
        buffers = _CrossBuffers(values, rows, length)
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

    def _write_cross(self, buffers: _CrossBuffers, rows: np.ndarray,
                     part: Sequence[Any]) -> None:
        """Write `part` (2L tensors [N,H,S,Dh], S <= Sc) into slots `rows` [N] of `buffers`,
        in place (one run of `static_step.cross_write_graph`)."""
        if not len(rows):
            return
        if self._cross_writer is None:
            from onnx import TensorProto

            elem = TensorProto.FLOAT16 if np.dtype(self.dtype) == np.float16 else \
                TensorProto.FLOAT
            options = ort.SessionOptions()
            options.log_severity_level = 3
            self._cross_writer = ort.InferenceSession(
                cross_write_graph(self.tensors, elem), sess_options=options,
                providers=self.providers)
        part = [self._device_value(value) for value in part]
        pads = np.zeros(8, np.int64)  # [b0,h0,t0,d0, b1,h1,t1,d1]: zeros after the columns
        pads[6] = buffers.length - part[0].shape()[2]
        small = {CROSS_ROWS: np.asarray(rows, np.int64).reshape(-1, 1),  # [N,1]
                 CROSS_PADS: pads}
        binding = self._cross_writer.io_binding()
        for name, value in small.items():
            binding.bind_cpu_input(name, value)
            self.counters.to_device += value.nbytes
        for i, (buffer, value) in enumerate(zip(buffers.values, part)):
            binding.bind_ortvalue_input(f"buffer_{i}", buffer)  # [Rc,H,Sc,Dh]
            binding.bind_ortvalue_input(f"part_{i}", value)  # [N,H,S,Dh]
            binding.bind_ortvalue_output(f"out_{i}", buffer)  # in place: the same address
        self.counters.runs += 1
        self._cross_writer.run_with_iobinding(binding)
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
        longest = max([length, *(_columns(part[0]) for part in parts)])
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
        rank = _rank_within(slot)  # [n]
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
            names = _StepNames(tuple(past_names), tuple(cross_names), tuple(outputs),
                               tuple(top_outputs))
            replay = target.replay = _Replay(self, decoder, target, cross_buffers, names)
        if read is None or read is target.sets[target.current]:  # the bucket's own binding
            binding = replay.bindings[target.current]
        else:  # the first step of a bucket reads the old one's buffers (or padded copies)
            binding = replay.bind(read, target.sets[1 - target.current])
        self._copy_inputs(replay, feeds, np.maximum(past.rows, 0), place, static_cross)
        self.counters.runs += 1
        decoder.run_with_iobinding(binding)
        # the written set is the cache now: the run is done, and a failed one changed nothing
        target.current = 1 - target.current
        target.generation += 1
        present = StaticPast(target, place.astype(np.int64), target.generation)
        # inside DeviceCache.logits_kept(), a step that does not fetch its logits leaves
        # them for `draw`: the bucket's [R,1,V], whose rows are the decoder's (`place`)
        kept = self._keep_logits and not need_logits
        self.step_logits = replay.outputs[outputs[0]] if kept else None
        self._step_place = place if kept else None
        tops = [self._fetch_rows(replay.outputs[name], place) for name in top_outputs]
        logits = None
        if need_logits:  # [n,1,V]
            logits = self._fetch_rows(replay.outputs[outputs[0]], place)
            logits = logits.astype(np.float32, copy=False)
        return StepOutput(logits, present, *tops)

    def draw(self, draws: Any) -> tuple[np.ndarray, np.ndarray]:
        """DeviceCache.draw on the last step's logits [R,1,V]: each draw's row of the batch
        read at its decoder row."""
        if self._step_place is not None:
            draws = draws._replace(rows=self._step_place[np.asarray(draws.rows, np.int64)])
        return super().draw(draws)  # type: ignore[misc]

    def _copy_inputs(self, replay: _Replay, feeds: dict[str, np.ndarray],
                     cache_rows: np.ndarray, place: np.ndarray, cross: StaticCross) -> None:
        """The step's inputs into the replay's values: each row's at its decoder row `place`,
        padding rows 0; the encoder mask at the sources' slots, a slot no source has one
        valid column (copied only when it changed)."""
        given = {"input_ids": feeds["input_ids"], "position_ids": feeds["position_ids"],
                 CACHE_ROWS: cache_rows}
        for name in ROW_INPUTS:
            host = replay.host[name]  # [R,1] or [R]
            host.fill(0)
            host.reshape(-1)[place] = np.asarray(given[name], np.int64).reshape(-1)  # [n]
            replay.inputs[name].update_inplace(host)
            self.counters.to_device += host.nbytes
        mask = replay.host[ENCODER_ATTENTION_MASK]  # [Rc,Sc]
        given_mask = feeds[ENCODER_ATTENTION_MASK]  # [M,S]
        mask.fill(0)
        mask[:, 0] = 1  # a slot no row reads: one valid column, so its softmax has one
        mask[cross.rows, : given_mask.shape[1]] = given_mask
        if replay.mask_sent is None or not np.array_equal(mask, replay.mask_sent):
            replay.inputs[ENCODER_ATTENTION_MASK].update_inplace(mask)
            replay.mask_sent = mask.copy()
            self.counters.to_device += mask.nbytes

    def _fetch_rows(self, value: ort.OrtValue, place: np.ndarray) -> np.ndarray:
        """Rows `place` of an output [R,...] as numpy (all R rows cross to the host)."""
        array = value.numpy()  # on CPU a view of the bound value, on a device a copy
        self.counters.to_host += array.nbytes
        return array[place]  # [n,...], a copy

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


def _columns(tensor: Any) -> int:
    """The time axis of a [N,H,S,Dh] tensor (an OrtValue or an array)."""
    return tensor.shape()[2] if isinstance(tensor, ort.OrtValue) else tensor.shape[2]


def _rank_within(slot: np.ndarray) -> np.ndarray:
    """Each entry's rank among the earlier entries of the same value (slots [4,7,4,2,2,2]:
    [0,0,1,0,1,2]), int64 [n]."""
    order = np.argsort(slot, kind="stable")
    ordered = slot[order]
    first = np.searchsorted(ordered, ordered, side="left")  # [n] where its value begins
    rank = np.empty(len(slot), np.int64)
    rank[order] = np.arange(len(slot)) - first
    return rank
