"""The static KV cache's buffers and what a search holds of them (`StaticPast`,
`StaticCross`), and a bucket's step bound once (`Replay`): the data of
`tfserve.runtime.static_cache`, whose module docstring tells how they are used."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.runtime.cache import DecoderNames
from tfserve.runtime.step_graph import CACHE_ROWS

ENCODER_ATTENTION_MASK = "encoder_attention_mask"
# the step's inputs with one row per decoder row, [R,1] or [R]; padding rows read 0
ROW_INPUTS = ("input_ids", "position_ids", CACHE_ROWS)
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32}


class Buffers:
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
        self.replay: Replay | None = None


class CrossBuffers:
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

    buffers: Buffers | None
    rows: np.ndarray  # int64 [n]
    generation: int = 0
    scratch: bool = False


@dataclass(frozen=True, eq=False)
class StaticCross:
    """Cross K/V as a search holds them: source i is row (slot) `rows[i]` of `buffers`; a
    slot repeated is a source whose rows each take it (the per-row layout). `writes`:
    `buffers.writes` when it was made."""

    buffers: CrossBuffers
    rows: np.ndarray  # int64 [M]
    writes: int

    def current(self) -> bool:
        """Whether every slot still holds the source it held when this was made."""
        return not len(self.rows) or int(self.buffers.written[self.rows].max()) <= self.writes


class Replay:
    """A bucket's step bound once: the small inputs and the outputs as OrtValues made here
    (inputs [R,1], [R] and [Rc,Sc], copied into each step; logits [R,1,V], top candidates
    [R,1,K]), and two IO bindings, `bindings[s]` reading buffer set s and writing the other,
    with the cross buffers. `bind` makes a binding of the same values for a step that reads
    other buffers (a bucket's first step, after growing)."""

    def __init__(self, device: tuple[str, int], decoder: ort.InferenceSession,
                 target: Buffers, cross: CrossBuffers, names: DecoderNames) -> None:
        self.decoder, self.cross, self.names = decoder, cross, names
        rows = target.rows
        memory, index = device
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

    def copy_inputs(self, feeds: dict[str, np.ndarray], cache_rows: np.ndarray,
                    place: np.ndarray, cross: StaticCross) -> int:
        """The step's inputs into this replay's values: each row's at its decoder row
        `place`, padding rows 0; the encoder mask at the sources' slots, a slot no source has
        one valid column (copied only when it changed). -> the bytes copied to the device."""
        moved = 0
        given = {"input_ids": feeds["input_ids"], "position_ids": feeds["position_ids"],
                 CACHE_ROWS: cache_rows}
        for name in ROW_INPUTS:
            host = self.host[name]  # [R,1] or [R]
            host.fill(0)
            host.reshape(-1)[place] = np.asarray(given[name], np.int64).reshape(-1)  # [n]
            self.inputs[name].update_inplace(host)
            moved += host.nbytes
        mask = self.host[ENCODER_ATTENTION_MASK]  # [Rc,Sc]
        given_mask = feeds[ENCODER_ATTENTION_MASK]  # [M,S]
        mask.fill(0)
        mask[:, 0] = 1  # a slot no row reads: one valid column, so its softmax has one
        mask[cross.rows, : given_mask.shape[1]] = given_mask
        if self.mask_sent is None or not np.array_equal(mask, self.mask_sent):
            self.inputs[ENCODER_ATTENTION_MASK].update_inplace(mask)
            self.mask_sent = mask.copy()
            moved += mask.nbytes
        return moved


def columns(tensor: Any) -> int:
    """The time axis of a [N,H,S,Dh] tensor (an OrtValue or an array)."""
    return tensor.shape()[2] if isinstance(tensor, ort.OrtValue) else tensor.shape[2]


def rank_within(slot: np.ndarray) -> np.ndarray:
    """Each entry's rank among the earlier entries of the same value (slots [4,7,4,2,2,2]:
    [0,0,1,0,1,2]), int64 [n]."""
    order = np.argsort(slot, kind="stable")
    ordered = slot[order]
    first = np.searchsorted(ordered, ordered, side="left")  # [n] where its value begins
    rank = np.empty(len(slot), np.int64)
    rank[order] = np.arange(len(slot)) - first
    return rank
