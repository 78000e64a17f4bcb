"""The rows of continuous batching and their layout: which search holds which rows, the
per-row bookkeeping the decoder takes (`position_ids`, `self_attention_mask`, the tokens fed
next), the backend's opaque caches, and the row operations between steps: searches joining
(`join`), leaving (`remove`), retiring and being compacted away, a beam step's reorder (done,
or left pending for the next step where the backend's step takes it), and the dead cache
columns cut on the way. `tfserve.generation.batch.DecodeBatch` adds the step.

It never looks inside the backend's cache tensors: every copy is a `Backend` row operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from tfserve.generation.backend import Backend, Cache
from tfserve.generation.search import Search


@dataclass
class Member:
    search: Search | Retired
    tag: Any  # the caller's handle (a request, an index)
    encoder_rows: int = 0  # valid source tokens, for trimming the cross-attention time axis

    @property
    def retired(self) -> bool:
        return isinstance(self.search, Retired)


class Retired:
    """The rows of a finished search, left in the batch until the next compaction: they
    step along on pad tokens at position 0, and what the decoder makes of them is ignored.

    Dropping a finished row means a copy of the whole cache (the other rows' self and cross
    K/V): with rows finishing one by one, as sentences of different lengths do, that was a
    copy per step. Retired rows wait for the next join, which copies the cache anyway and
    drops them in the same pass, or for enough of them to be worth a copy of their own
    (`DecodeBatch.RETIRED_SHARE`, `RETIRED_STEPS`).
    """

    def __init__(self, rows: int, pad_token_id: int, since: int) -> None:
        self.rows = rows
        self.since = since  # the batch's step count when it retired
        self.last_tokens = np.full(rows, pad_token_id, np.int64)
        self.parents = np.arange(rows)

    def top_needed(self) -> int:
        return 1  # any candidates will do: they are ignored

    def candidates_per_row(self) -> int:
        return 0


class Joining(NamedTuple):
    """Searches joining a DecodeBatch together with their encoder run's outputs: one start row
    each; `cross` [N,H,S,Dh] per layer and `encoder_attention_mask` [N,S]."""

    searches: Sequence[Search]
    tags: Sequence[Any]
    cross: Cache
    encoder_attention_mask: np.ndarray



@dataclass
class BatchRows:
    """The rows of a DecodeBatch and their layout: rows added, removed, reordered and
    condensed between steps (the step itself and the decisions are `DecodeBatch`'s).

    Row bookkeeping (numpy): `position_ids` [R] of the next token, `self_attention_mask`
    [R,P] over the cache; the backend's `past` cache [R,H,P,Dh] per layer. The members'
    rows are contiguous blocks in member order. The encoder side is kept once per member,
    not per row: `cross` [M,H,S,Dh] per layer and `encoder_attention_mask` [M,S], so beams
    never copy their sentence's K/V. When every member has the same number of rows G, the
    decoder gets them as they are (grouped cross-attention, graph revision 5); otherwise
    (or with older graphs) they are repeated to one per row for the step, and that copy is
    kept until the layout changes. `slots` holds every member's rows, finished ones included
    until a compaction (`Retired`); `members` are the searches still running.
    """

    backend: Backend
    # every member's rows, in row order; finished members' rows stay as Retired until the
    # next compaction
    slots: list[Member] = field(default_factory=list)
    past: Cache = None
    cross: Cache = None
    self_attention_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    encoder_attention_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    position_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    steps: int = 0
    # where the backend's step takes a reorder (`Backend.reorders_in_step`: it honours the
    # step's `parents` for less than a row operation before it), a beam step's reorder waits
    # for the next step: row i continues row pending_parents[i] of `past`. None: `past` is
    # in row order
    pending_parents: np.ndarray | None = None
    _per_row: tuple | None = None  # (layout, cross, its rows repeated per decoder row, mask)
    # compact (copy the cache without the retired rows) when they are this share of the rows
    # (1/RETIRED_SHARE), or when the oldest retired RETIRED_STEPS steps ago
    RETIRED_SHARE = 8
    RETIRED_STEPS = 8

    @property
    def rows(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def members(self) -> list[Member]:
        """The searches still running, in row order."""
        return [member for member in self.slots if not member.retired]

    @property
    def retired_rows(self) -> int:
        return sum(member.search.rows for member in self.slots if member.retired)

    def __len__(self) -> int:
        return sum(1 for member in self.slots if not member.retired)

    def _live_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows and slot positions of the running members (the retired ones dropped)."""
        rows, positions, row = [], [], 0
        for position, member in enumerate(self.slots):
            if not member.retired:
                rows.append(np.arange(row, row + member.search.rows))
                positions.append(position)
            row += member.search.rows
        return (np.concatenate(rows) if rows else np.zeros(0, np.int64),
                np.array(positions, np.int64))

    def add(self, searches: Sequence[Search], tags: Sequence[Any], cross: Cache,
            encoder_attention_mask: np.ndarray) -> None:
        """Join new searches (one start row each) with their encoder outputs [N,...]."""
        self.join([Joining(searches, tags, cross, encoder_attention_mask)])

    def join(self, groups: Sequence[Joining]) -> None:
        """Join the searches of several encoder runs at once: the running cache, the
        newcomers' empty history and every group's cross K/V go through one
        `Backend.concat_rows` per cache, not one per group (one copy per tensor, where the
        backend can)."""
        groups = [group for group in groups if len(group.searches)]
        if not groups:
            return
        for group in groups:
            if len(group.searches) != group.encoder_attention_mask.shape[0]:
                raise ValueError("one encoder row per search is required")
        count = sum(len(group.searches) for group in groups)
        masks = [group.encoder_attention_mask.astype(np.int64, copy=False) for group in groups]
        crosses = [group.cross for group in groups]
        # retired rows leave in the copy the join makes anyway, and so do the cache columns
        # that no kept row uses (what _reorder cuts when rows leave between joins)
        keep_rows = keep_slots = past_time = cross_time = None
        if self.rows and self.retired_rows:
            keep_rows, keep_slots = self._live_index()
            self.slots = [self.slots[i] for i in keep_slots]
            self.self_attention_mask = self.self_attention_mask[keep_rows]
            self.encoder_attention_mask = self.encoder_attention_mask[keep_slots]
            self.position_ids = self.position_ids[keep_rows]
            self.last_tokens = self.last_tokens[keep_rows]
            self._per_row = None
            first, src_len = self._used_columns()
            if first > 0:
                past_time = (first, self.self_attention_mask.shape[1])
                self.self_attention_mask = self.self_attention_mask[:, first:]
            if src_len < self.encoder_attention_mask.shape[1]:
                cross_time = (0, src_len)
                self.encoder_attention_mask = self.encoder_attention_mask[:, :src_len]
        if self.rows:
            masks.insert(0, self.encoder_attention_mask)
            crosses.insert(0, self.cross)
        src_len = max(mask.shape[1] for mask in masks)
        backend = self.backend
        # every member's cross K/V and mask padded on the right to the longest source
        self.cross = (backend.pad_time(crosses[0], src_len, left=False) if len(crosses) == 1
                      else backend.concat_rows(crosses, src_len, left=False,
                                               first_rows=keep_slots, first_time=cross_time))
        masks = [pad_right(mask, src_len) for mask in masks]
        self.encoder_attention_mask = masks[0] if len(masks) == 1 else np.concatenate(masks)
        new_past = backend.empty_past(count)
        if self.rows:
            # the newcomers have no history: holes (mask 0) where the others have a cache
            past_len = self.self_attention_mask.shape[1]
            if keep_rows is not None and self.pending_parents is not None:
                # one gather: the pending reorder and the kept rows together
                keep_rows, self.pending_parents = self.pending_parents[keep_rows], None
            self.past = backend.concat_rows([self._ordered_past(), new_past], past_len,
                                            left=True,
                                            first_rows=keep_rows, first_time=past_time)
            self.self_attention_mask = np.concatenate(
                [self.self_attention_mask, np.zeros((count, past_len), np.int64)])
        else:
            self.past = new_past
            self.self_attention_mask = np.zeros((count, 0), np.int64)
        # each newcomer's first input is its own start token (DecodingOptions'
        # decoder_start_token_id, else the model's): rows may start from different tokens
        starts = []
        for group in groups:
            for search, tag, valid in zip(group.searches, group.tags,
                                          group.encoder_attention_mask.sum(axis=1)):
                self.slots.append(Member(search, tag, int(valid)))
                starts.append(search.last_tokens[0])
        self.position_ids = np.concatenate([self.position_ids, np.zeros(count, np.int64)])
        self.last_tokens = np.concatenate([self.last_tokens, np.array(starts, np.int64)])

    def remove(self, tags: set[Any]) -> list[Search]:
        """Drop the members with these tags (cancelled, expired) before the next step."""
        keep_index, kept, kept_members, removed, row = [], [], [], [], 0
        for position, member in enumerate(self.slots):
            rows = range(row, row + member.search.rows)
            row += member.search.rows
            if member.retired:
                continue  # a copy is made: retired rows leave with these
            if member.tag in tags:
                removed.append(member.search)  # type: ignore[arg-type]
            else:
                kept.append(member)
                kept_members.append(position)
                keep_index.extend(rows)
        if removed:
            self._reorder(np.array(keep_index, np.int64), kept,
                          np.array(kept_members, np.int64))
        return removed

    def _cross_for_step(self) -> tuple[Cache, np.ndarray]:
        """The cross K/V and encoder mask in the form the decoder takes this step."""
        layout = tuple(member.search.rows for member in self.slots)
        grouped = getattr(self.backend, "grouped_cross", False)
        if len(set(layout)) == 1 and (grouped or layout[0] == 1):
            return self.cross, self.encoder_attention_mask  # [M,...]: G rows per member
        cached = self._per_row
        if cached is None or cached[0] != layout or cached[1] is not self.cross:
            index = np.repeat(np.arange(len(layout)), layout)  # member of each row
            cached = self._per_row = (layout, self.cross,
                                      self.backend.take_rows(self.cross, index),
                                      self.encoder_attention_mask[index])
        return cached[2], cached[3]

    def _ordered_past(self) -> Cache:
        """The past in row order: a reorder left to the next step (pending_parents) done now."""
        if self.pending_parents is not None:
            self.past = self.backend.take_rows(self.past, self.pending_parents)
            self.pending_parents = None
        return self.past

    def _used_columns(self) -> tuple[int, int]:
        """The first self-attention cache column some row uses, and the source length the
        longest running member needs: columns that every row has as a hole (left) or as
        padding (right) are dead weight in every later step, cut by whoever copies next."""
        mask = self.self_attention_mask
        if mask.shape[1] and mask[:, 0].any():
            first = 0  # the usual case, without a pass over the whole mask
        else:
            filled = mask.any(axis=0)
            first = int(filled.argmax()) if filled.any() else mask.shape[1]
        return first, max(member.encoder_rows for member in self.slots)

    def _compact_now(self) -> bool:
        """Whether the retired rows should leave now rather than at the next join."""
        live = len(self)
        retired = [member.search for member in self.slots if member.retired]
        if not live or not retired:
            return bool(retired)
        share = sum(search.rows for search in retired) * self.RETIRED_SHARE >= self.rows
        oldest = min(search.since for search in retired)  # type: ignore[union-attr]
        return share or self.steps - oldest >= self.RETIRED_STEPS

    def _reorder(self, index: np.ndarray, members: list[Member],
                 member_index: np.ndarray | None) -> None:
        """Keep rows `index` (in that order) for `members`, trimming dead cache columns.

        member_index: which of the previous members `members` are (None: the same ones).
        """
        previous_rows = self.rows
        self.slots = members
        if not members:
            self.past = self.cross = self.pending_parents = None
            self.self_attention_mask = np.zeros((0, 0), np.int64)
            self.encoder_attention_mask = np.zeros((0, 0), np.int64)
            self.position_ids = np.zeros(0, np.int64)
            self.last_tokens = np.zeros(0, np.int64)
            return
        identity = len(index) == previous_rows and bool((index == np.arange(previous_rows)).all())
        if not identity:
            self.self_attention_mask = self.self_attention_mask[index]
            first, _ = self._used_columns()
            if (member_index is None and first == 0
                    and getattr(self.backend, "reorders_in_step", False)):
                # the next step gathers the rows (a beam step: the same rows, reordered)
                pending = self.pending_parents
                self.pending_parents = index if pending is None else pending[index]
            else:
                rows = index if self.pending_parents is None else self.pending_parents[index]
                self.pending_parents = None
                # the past is always this batch's own (a fresh present, or made by add/remove)
                self.past = self.backend.take_rows(self.past, rows, reuse=True)
            if member_index is not None:
                self.cross = self.backend.take_rows(self.cross, member_index)
                self.encoder_attention_mask = self.encoder_attention_mask[member_index]
            self.position_ids = self.position_ids[index]
            if len(self.last_tokens) == previous_rows:
                self.last_tokens = self.last_tokens[index]
            src_len = max(member.encoder_rows for member in self.slots)  # as _used_columns
            if first > 0:  # pending_parents is None: the rows were taken above
                stop = self.self_attention_mask.shape[1]
                self.past = self.backend.slice_time(self.past, first, stop)
                self.self_attention_mask = self.self_attention_mask[:, first:]
            if src_len < self.encoder_attention_mask.shape[1]:
                self.cross = self.backend.slice_time(self.cross, 0, src_len)
                self.encoder_attention_mask = self.encoder_attention_mask[:, :src_len]


def pad_right(mask: np.ndarray, length: int) -> np.ndarray:
    if mask.shape[1] >= length:
        return mask
    return np.pad(mask, ((0, 0), (0, length - mask.shape[1])))
