"""Continuous batching: the rows of many searches decoded together, one token per step.

`DecodeBatch` is the one decoding loop (the server's scheduler and offline `generate` both
run it). Between two steps, searches that finished retire and new ones join, which the
per-row `position_ids` and `self_attention_mask` of the decoder interface make possible: a
row that joins late has holes (mask 0) where the others have history. The searches
themselves (greedy, beam, sampling) and the backend protocol are in `tfserve.generation`;
this module only moves rows: it never looks inside the backend's cache tensors.

A step fetches the [R,V] logits only when some member reads whole rows itself. Members
decide from the backend's top candidates where those serve them (greedy, beam, top-k
sampling); a sampling member that may draw any token has its draws made where the logits
were made, where the backend draws on its device (`Search.device_draw`, `SampleDraws`:
tfserve.runtime.sampling_graph; the draws go with the step, whose one run makes them where
the backend's decoder graph draws), so that a step of such members moves nothing of
vocabulary size either. Repetition controls read whole rows: a step with such a member fetches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any, NamedTuple

import numpy as np

from tfserve.generation import (
    Backend,
    Cache,
    DecodingOptions,
    GroupDecision,
    Hypothesis,
    Search,
    StepOutput,
    banned_tokens,
    make_search,
    score_rows,
)
from tfserve.generation.search import SampleDraws


class BatchRunError(RuntimeError):
    """The decoder run of a step failed; the batch is as it was before the step."""


@dataclass
class _Member:
    search: Search | _Retired
    tag: Any  # the caller's handle (a request, an index)
    encoder_rows: int = 0  # valid source tokens, for trimming the cross-attention time axis

    @property
    def retired(self) -> bool:
        return isinstance(self.search, _Retired)


class _Retired:
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
class DecodeBatch:
    """Rows of many searches decoded together, one token per step.

    Row bookkeeping (numpy): `position_ids` [R] of the next token, `self_attention_mask`
    [R,P] over the cache; the backend's `past` cache [R,H,P,Dh] per layer. The members'
    rows are contiguous blocks in member order. The encoder side is kept once per member,
    not per row: `cross` [M,H,S,Dh] per layer and `encoder_attention_mask` [M,S], so beams
    never copy their sentence's K/V. When every member has the same number of rows G, the
    decoder gets them as they are (grouped cross-attention, graph revision 5); otherwise
    (or with older graphs) they are repeated to one per row for the step, and that copy is
    kept until the layout changes. `slots` holds every member's rows, finished ones included
    until a compaction (`_Retired`); `members` are the searches still running.
    """

    backend: Backend
    # every member's rows, in row order; finished members' rows stay as _Retired until the
    # next compaction
    slots: list[_Member] = field(default_factory=list)
    past: Cache = None
    cross: Cache = None
    self_attention_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    encoder_attention_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    position_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    steps: int = 0
    # where the backend reorders the cache inside its step (`reorders_in_step`: the device
    # placement, one run per step), a beam step's reorder waits for the next step: row i
    # continues row past_rows[i] of `past`. None: `past` is in row order
    past_rows: np.ndarray | None = None
    _per_row: tuple | None = None  # (layout, cross, its rows repeated per decoder row, mask)
    # decide greedy and beam rows from the backend's top candidates when it has them (off:
    # always from the full logits; both give the same tokens, see tests/runtime/test_runtime.py)
    use_top_candidates: bool = True
    # decide the members that decide from top candidates together, strategy by strategy, in
    # a few numpy operations over all their rows (`Search.decide_group`). Off: each member
    # through its own `advance_candidates`, the reference path (both give the same tokens and
    # scores: tests/generation/test_vectorised_search.py; bench.search_overhead times both)
    group_decisions: bool = True
    # (what the backend's bans were read from, the banned ids [n] or None, the candidates per
    # row left for a search's own): banned_tokens and _plan's room once per backend state
    _bans: tuple | None = field(default=None, init=False, repr=False, compare=False)

    # compact (copy the cache without the retired rows) when they are this share of the rows
    # (1/RETIRED_SHARE), or when the oldest retired RETIRED_STEPS steps ago
    RETIRED_SHARE = 8
    RETIRED_STEPS = 8

    @property
    def rows(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def members(self) -> list[_Member]:
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
        `Backend.concat_rows` per cache, not one per group (on the host that is one copy per
        tensor; the device path still concatenates pairwise inside it)."""
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
        masks = [_pad_right(mask, src_len) for mask in masks]
        self.encoder_attention_mask = masks[0] if len(masks) == 1 else np.concatenate(masks)
        new_past = backend.empty_past(count)
        if self.rows:
            # the newcomers have no history: holes (mask 0) where the others have a cache
            past_len = self.self_attention_mask.shape[1]
            if keep_rows is not None and self.past_rows is not None:
                keep_rows, self.past_rows = self.past_rows[keep_rows], None  # one gather
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
                self.slots.append(_Member(search, tag, int(valid)))
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

    def step(self) -> list[tuple[Any, Search]]:
        """Run one decoder step for every row; returns the members that finished.

        A search that raises while it decides its tokens finishes too, with `search.error`
        set: it fails alone, and the other rows' step goes on. An exception from here (the
        backend's run, a cache copy) belongs to the whole batch.
        """
        if all(isinstance(member.search, _Retired) for member in self.slots):
            return []
        cross, encoder_attention_mask = self._cross_for_step()
        # [R,P] -> [R,P+1]: the new token's column; the same array is the mask of the cache
        # after the step (the backend only reads it)
        self_attention_mask = np.concatenate(
            [self.self_attention_mask, np.ones((self.rows, 1), np.int64)], axis=1)
        # every member deciding from the backend's top candidates, or drawing where the
        # logits are: the step leaves the [R,V] logits where they were made (on a device:
        # nothing of vocabulary size moves)
        _, banned, room = self._banned()  # [n] or None; candidates per row for the searches
        drawer = self._drawer()
        plan = self._plan(room, drawer is not None)
        from_top = plan is not None
        groups, drawing = plan if plan is not None else (None, [])
        draws = _joined_draws(drawing, banned) if drawing else None
        try:
            # the draws go with the step: where its graph draws, its one run makes them
            with drawer.logits_kept(draws) if draws is not None else nullcontext():
                out = self.backend.step(
                    self.last_tokens[:, None],  # [R,1]
                    self.position_ids[:, None],  # [R,1]
                    self_attention_mask,
                    encoder_attention_mask,
                    self.past,
                    cross,
                    **({"need_logits": False} if from_top else {}),
                    **({"cache_rows": self.past_rows} if self.past_rows is not None else {}),
                )
                # [S] each: the drawing members' tokens and log-probabilities, member by member
                drawn = drawer.draw(draws) if draws is not None else None
        except Exception as exc:  # nothing has changed yet: the batch can be stepped again
            raise BatchRunError(f"decoder run failed: {exc}") from exc
        if from_top and (out.top_ids is None or out.top_log_probs is None):
            raise BatchRunError("the backend declares top candidates, but its step gave none")
        self.steps += 1
        self.past, self.past_rows = out.present, None
        self.self_attention_mask = self_attention_mask
        # the model's banned tokens (the checkpoint's bad_words_ids, from model.json; pad for
        # older exports) go to -inf after the normaliser is taken, without renormalising: the
        # scores then equal transformers' with those bad_words_ids
        pad = self.backend.pad_token_id
        top = self._candidates(out, banned) if from_top else None
        if top is None:
            # [R,V]; the backend hands over a fresh array, so score_rows edits it in place;
            # beam candidates of every row come from one threaded pass
            logits = out.logits[:, -1, :].astype(np.float32, copy=False)
            beam_k = max((m.search.candidates_per_row() for m in self.slots), default=0)
            lse, best = score_rows(logits, banned, beam_k)  # [R], [R,k]
        starts = list(accumulate((m.search.rows for m in self.slots), initial=0))  # [M+1]
        decisions = self._decide_groups(groups, *top) if groups else []
        # slot position -> its draws' [start, stop) in `drawn`
        draw_bounds = dict(zip((position for position, _ in drawing),
                               pairwise(accumulate((len(part.rows) for _, part in drawing),
                                                   initial=0))))
        # the group members first, group by group: their next rows are their decision's
        ended: set[int] = set()  # slot positions of group members that finished
        going: set[int] = set()  # those that go on
        for decision, positions, searches, _ in decisions:
            bounds = decision.bounds
            for part, search in enumerate(searches):
                try:
                    search.take_decision(decision, part)
                except Exception as exc:  # this search's own failure: it ends alone, with it
                    search.error = exc
                    search.done = True
                if search.done:
                    ended.add(positions[part])
                else:
                    search.rows = bounds[part + 1] - bounds[part]
            going.update(positions)
        going -= ended
        # then slot by slot, the others: the next rows of each, (slot position, each row's
        # row before the step [n], its token [n]); a finished search's rows retire
        pieces: list[tuple[Any, np.ndarray, np.ndarray]] = []
        finished, retired = [], []
        for position, member in enumerate(self.slots):
            if position in going:
                continue
            search = member.search
            row, rows = starts[position], starts[position + 1] - starts[position]
            if isinstance(search, _Retired):
                pieces.append((position, search.parents + row, search.last_tokens))
                retired.append(np.arange(row, row + rows))
                continue
            if position in ended:
                parents = new_tokens = np.zeros(0, np.int64)
            else:
                try:
                    if position in draw_bounds:
                        first, stop = draw_bounds[position]
                        parents, new_tokens = search.advance_drawn(
                            drawn[0][first:stop], drawn[1][first:stop])  # type: ignore[index]
                    elif top is not None:
                        parents, new_tokens = search.advance_candidates(
                            top[0][row : row + rows], top[1][row : row + rows])
                    else:
                        parents, new_tokens = search.advance(
                            logits[row : row + rows], lse[row : row + rows],
                            None if best is None else best[row : row + rows])
                except Exception as exc:  # this search's own failure: it ends alone, with it
                    search.error = exc
                    search.done = True
                    parents, new_tokens = np.zeros(0, np.int64), np.zeros(0, np.int64)
            search.rows = len(parents)
            if search.done:  # its rows stay, retired, until the next compaction
                finished.append((member.tag, search))
                self.slots[position] = member = _Member(_Retired(rows, pad, self.steps), None)
                parents, new_tokens = member.search.parents, member.search.last_tokens
                retired.append(np.arange(row, row + rows))
            pieces.append((position, parents + row, new_tokens))
        index, last_tokens = self._next_rows(pieces, decisions, ended)  # old row per row
        self.position_ids = self.position_ids + 1
        if retired:
            self.position_ids[np.concatenate(retired)] = 0  # never past the position table
        if retired and self._compact_now():
            # the retired rows leave: keep_rows are the running rows after this step
            keep_rows, keep_slots = self._live_index()
            self._reorder(index[keep_rows], [self.slots[i] for i in keep_slots], keep_slots)
            last_tokens = last_tokens[keep_rows]
        else:
            self._reorder(index, self.slots, None)  # the encoder side (per member) unchanged
        self.last_tokens = last_tokens
        return finished

    @staticmethod
    def _next_rows(pieces: list[tuple[Any, np.ndarray, np.ndarray]],
                   decisions: list[tuple[GroupDecision, list[int], list[Search], np.ndarray]],
                   ended: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each next row's row before the step [R'] and its token [R'], in slot order, from
        the slots' own `pieces` (slot position, rows, tokens) and the group `decisions`
        (decision, slot positions, searches, its parents as rows of the batch), less the rows
        of the group members that `ended`."""
        if not decisions:  # the pieces are in slot order
            if not pieces:
                return np.zeros(0, np.int64), np.zeros(0, np.int64)
            return (np.concatenate([piece[1] for piece in pieces]),
                    np.concatenate([piece[2] for piece in pieces]))
        if len(decisions) == 1 and not pieces and not ended:  # one group: every slot
            return decisions[0][3], decisions[0][0].tokens
        for decision, positions, _, parents in decisions:
            counts = np.diff(decision.bounds)  # [M] next rows per member
            slots = np.repeat(np.array(positions, np.int64), counts)  # [n] slot of each row
            tokens = decision.tokens
            if ended.intersection(positions):
                going = np.repeat([position not in ended for position in positions], counts)
                slots, parents, tokens = slots[going], parents[going], tokens[going]
            pieces.append((slots, parents, tokens))
        slots = np.concatenate([np.full(len(piece[1]), piece[0], np.int64)
                                if isinstance(piece[0], int) else piece[0] for piece in pieces])
        order = np.argsort(slots, kind="stable")  # slot order; a slot's rows keep theirs
        return (np.concatenate([piece[1] for piece in pieces])[order],
                np.concatenate([piece[2] for piece in pieces])[order])

    def run_alone(self, tag: Any) -> BaseException | None:
        """Run the decoder for one member's rows alone, on copies (the batch is unchanged);
        returns the exception the run raised, or None. After a failed batch run, this finds
        the rows the model cannot take, so that only their request fails."""
        starts = np.cumsum([0] + [m.search.rows for m in self.slots])  # first row per slot
        position = next((i for i, m in enumerate(self.slots)
                         if m.tag is tag and not m.retired), None)
        if position is None:
            raise KeyError(f"no running member with tag {tag!r}")
        row, rows = int(starts[position]), self.slots[position].search.rows
        index = np.arange(row, row + rows)  # this member's rows
        backend = self.backend
        grouped = getattr(backend, "grouped_cross", False)
        # its sentence's cross K/V once (grouped), or once per row
        member_rows = np.full(1 if grouped or rows == 1 else rows, position)
        try:
            backend.step(
                self.last_tokens[index][:, None],  # [r,1]
                self.position_ids[index][:, None],  # [r,1]
                np.concatenate([self.self_attention_mask[index],
                                np.ones((rows, 1), np.int64)], axis=1),  # [r,P+1]
                self.encoder_attention_mask[member_rows],  # [1 or r,S]
                backend.take_rows(self.past, index if self.past_rows is None
                                  else self.past_rows[index]),
                backend.take_rows(self.cross, member_rows),
            )
        except Exception as exc:
            return exc
        return None

    def _ordered_past(self) -> Cache:
        """The past in row order: a reorder left to the next step (past_rows) done now."""
        if self.past_rows is not None:
            self.past = self.backend.take_rows(self.past, self.past_rows)
            self.past_rows = None
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

    def _banned(self) -> tuple:
        """(the backend state it was read from, `banned_tokens` [n] or None, the candidates
        per row left for a search's own: K less eos and the banned ids, K where K = V, 0
        where the backend gives none)."""
        backend = self.backend
        source = (getattr(backend, "banned_token_ids", None), backend.pad_token_id,
                  backend.eos_token_id, getattr(backend, "top_candidates", 0),
                  backend.vocab_size)
        if self._bans is None or self._bans[0] != source:
            banned = banned_tokens(backend)
            k = source[3]
            reserved = {backend.eos_token_id, *(() if banned is None else banned.tolist())}
            room = k if k >= backend.vocab_size else max(k - len(reserved), 0)
            self._bans = (source, banned, room)
        return self._bans

    def _plan(self, room: int, drawing: bool) -> tuple[
            dict[tuple, tuple[list[int], list[int], list[Search]]],
            list[tuple[int, SampleDraws]]] | None:
        """None unless every running member can decide this step from the K best candidates
        per row that the backend computes (`Backend.top_candidates`; 0: it computes none),
        of which `room` are left for its own (K = V: every token is a candidate; else room
        for the needed ones plus the banned tokens and eos, banned before min_new_tokens),
        or, where `drawing` (the backend draws where the logits are), has its whole-row
        draws made there (`Search.device_draw`). Then: the groups that decide together
        (`Search.group_key`, with group_decisions), (strategy, key) -> (slot positions,
        their first rows, their searches); and the drawing members, (slot position, its
        draws with rows of the batch), in slot order."""
        if not room or not self.use_top_candidates:
            return None
        grouping = self.group_decisions
        groups: dict[tuple, tuple[list[int], list[int], list[Search]]] = {}
        draws: list[tuple[int, SampleDraws]] = []
        row = 0
        for position, member in enumerate(self.slots):
            search = member.search
            if not isinstance(search, _Retired):
                key = search.group_key() if grouping else None
                if key is None:
                    needed = search.top_needed()
                    if needed == 0 or needed > room:
                        part = search.device_draw() if drawing else None
                        if part is None:
                            return None
                        draws.append((position, part._replace(rows=part.rows + row)))
                else:
                    group = groups.get((type(search), key))
                    if group is None:
                        group = groups[(type(search), key)] = ([], [], [])
                    group[0].append(position)
                    group[1].append(row)
                    group[2].append(search)
            row += search.rows
        for _, _, searches in groups.values():  # equal keys: equal needs (Search.group_key)
            needed = searches[0].top_needed()
            if needed == 0 or needed > room:
                return None
        return groups, draws

    def _drawer(self) -> Any:
        """What draws samples where the step's logits are made (`logits_kept(draws)`, `draw`: see
        tfserve.runtime.cache.DeviceCache), None where nothing does (whole rows then come
        to the host): the backend itself, or its cache placement (a Runtime's), where it
        says it `draws_on_device`."""
        backend = self.backend
        for drawer in (backend, getattr(backend, "cache_storage", None)):
            if getattr(drawer, "draws_on_device", False):
                return drawer
        return None

    def _decide_groups(self, groups: dict[tuple, tuple[list[int], list[int], list[Search]]],
                       ids: np.ndarray, log_probs: np.ndarray
                       ) -> list[tuple[GroupDecision, list[int], list[Search], np.ndarray]]:
        """The group decisions of this step (`Search.decide_group`) from the top candidates
        ids, log_probs [R,K]: (decision, its members' slot positions, their searches, its
        parents as rows of the batch). The members of a group whose decision raised are
        left out: each then decides (and fails, if it does) alone, through its
        advance_candidates."""
        decisions = []
        for (strategy, _), (positions, starts, searches) in groups.items():
            counts = [search.rows for search in searches]
            total = sum(counts)
            if starts[0] == 0 and total == len(ids):
                rows = None  # every row, in order
            else:  # [n] the group's rows: each member's block, member by member
                first = np.array(starts, np.int64)
                counts_array = np.array(counts, np.int64)
                rows = (np.repeat(first - (np.cumsum(counts_array) - counts_array), counts_array)
                        + np.arange(total))
            try:
                decision = strategy.decide_group(
                    searches, ids if rows is None else ids[rows],
                    log_probs if rows is None else log_probs[rows])
            except Exception:
                continue
            parents = decision.parents if rows is None else rows[decision.parents]
            decisions.append((decision, positions, searches, parents))
        return decisions

    def _candidates(self, out: StepOutput, banned: np.ndarray | None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's top candidates: ids [R,K], log-probs [R,K], the `banned` ids at -inf."""
        ids, log_probs = out.top_ids[:, -1, :], out.top_log_probs[:, -1, :]
        log_probs = log_probs.astype(np.float32)  # a copy: edited below
        if banned is not None:
            if len(banned) <= 4:  # a few comparisons cost less than np.isin's sort
                for token in banned.tolist():
                    log_probs[ids == token] = -np.inf
            else:
                log_probs[np.isin(ids, banned)] = -np.inf
        return ids.astype(np.int64, copy=False), log_probs

    def _reorder(self, index: np.ndarray, members: list[_Member],
                 member_index: np.ndarray | None) -> None:
        """Keep rows `index` (in that order) for `members`, trimming dead cache columns.

        member_index: which of the previous members `members` are (None: the same ones).
        """
        previous_rows = self.rows
        self.slots = members
        if not members:
            self.past = self.cross = self.past_rows = None
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
                self.past_rows = index if self.past_rows is None else self.past_rows[index]
            else:
                rows = index if self.past_rows is None else self.past_rows[index]
                self.past_rows = None
                # the past is always this batch's own (a fresh present, or made by add/remove)
                self.past = self.backend.take_rows(self.past, rows, reuse=True)
            if member_index is not None:
                self.cross = self.backend.take_rows(self.cross, member_index)
                self.encoder_attention_mask = self.encoder_attention_mask[member_index]
            self.position_ids = self.position_ids[index]
            if len(self.last_tokens) == previous_rows:
                self.last_tokens = self.last_tokens[index]
            src_len = max(member.encoder_rows for member in self.slots)  # as _used_columns
            if first > 0:  # past_rows is None: the rows were taken above
                stop = self.self_attention_mask.shape[1]
                self.past = self.backend.slice_time(self.past, first, stop)
                self.self_attention_mask = self.self_attention_mask[:, first:]
            if src_len < self.encoder_attention_mask.shape[1]:
                self.cross = self.backend.slice_time(self.cross, 0, src_len)
                self.encoder_attention_mask = self.encoder_attention_mask[:, :src_len]


def _joined_draws(drawing: list[tuple[int, SampleDraws]], banned: np.ndarray | None
                  ) -> SampleDraws:
    """The drawing members' draws as one request [S] (member by member), with the bans
    of the batch's candidates and whole rows (`banned`)."""
    parts = [part for _, part in drawing]
    return SampleDraws(*(np.concatenate([getattr(part, name) for part in parts])
                         for name in ("rows", "uniforms", "temperature", "top_k", "top_p",
                                      "block_eos")),
                       eos_token_id=parts[0].eos_token_id, banned=banned)


def _pad_right(mask: np.ndarray, length: int) -> np.ndarray:
    if mask.shape[1] >= length:
        return mask
    return np.pad(mask, ((0, 0), (0, length - mask.shape[1])))


def generate(
    backend: Backend,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    options: DecodingOptions | Sequence[DecodingOptions],
    use_top_candidates: bool = True,
) -> list[list[Hypothesis]]:
    """Translate a batch of encoded sources; one ranked hypothesis list per source.

    `options` may be one DecodingOptions for all sources or one per source;
    use_top_candidates False: every step takes whole logits rows (DecodeBatch's reference).
    """
    count = input_ids.shape[0]
    per_source = [options] * count if isinstance(options, DecodingOptions) else list(options)
    if len(per_source) != count:
        raise ValueError(f"got {len(per_source)} DecodingOptions for {count} sources")
    limit = backend.max_target_positions - 1
    per_source = [opts.validate(max_new_tokens_limit=limit, vocab_size=backend.vocab_size,
                                eos_token_id=backend.eos_token_id) for opts in per_source]
    _, cross = backend.encode(input_ids, attention_mask)
    batch = DecodeBatch(backend, use_top_candidates=use_top_candidates)
    searches = [
        make_search(opts, backend.eos_token_id, backend.decoder_start_token_id)
        for opts in per_source
    ]
    batch.add(searches, list(range(count)), cross, attention_mask)
    results: list[list[Hypothesis]] = [[] for _ in range(count)]
    while len(batch):
        for tag, search in batch.step():
            if search.error is not None:
                raise search.error
            results[tag] = search.results()
    return results
