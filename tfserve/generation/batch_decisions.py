"""What a DecodeBatch step decides with, and how its pieces come back together: the plan
(whether every running member can decide from the backend's top candidates or have its draws
made in the step, and which members decide together), the group decisions, the candidates
with the bans applied, the drawing members' draws joined into one request, and the next
rows in slot order. Pure functions over numpy and the searches; no backend call."""

from __future__ import annotations

from typing import Any

import numpy as np

from tfserve.generation.backend import Backend, SampleDraws, StepOutput, banned_tokens
from tfserve.generation.batch_rows import Member, Retired
from tfserve.generation.search import GroupDecision, Search

# (strategy, group key) -> (slot positions, their first rows, their searches)
Groups = dict[tuple, tuple[list[int], list[int], list[Search]]]


def bans_source(backend: Backend) -> tuple:
    """What `bans` reads of the backend (a new value: read them again)."""
    return (getattr(backend, "banned_token_ids", None), backend.pad_token_id,
            backend.eos_token_id, getattr(backend, "top_candidates", 0), backend.vocab_size)


def bans(backend: Backend) -> tuple:
    """(the backend state they are read from, `banned_tokens` [n] or None, the candidates
    per row left for a search's own: K less eos and the banned ids, K where K = V, 0 where
    the backend gives none)."""
    source = bans_source(backend)
    banned = banned_tokens(backend)
    k = source[3]
    reserved = {backend.eos_token_id, *(() if banned is None else banned.tolist())}
    room = k if k >= backend.vocab_size else max(k - len(reserved), 0)
    return source, banned, room


def plan(slots: list[Member], room: int, drawing: bool, grouping: bool,
         use_top_candidates: bool = True
         ) -> tuple[Groups, list[tuple[int, SampleDraws]]] | None:
    """None unless every running member can decide this step from the K best candidates
    per row that the backend computes (`Backend.top_candidates`; 0: it computes none),
    of which `room` are left for its own (K = V: every token is a candidate; else room
    for the needed ones plus the banned tokens and eos, banned before min_new_tokens),
    or, where `drawing` (the backend draws where the logits are), has its whole-row
    draws made there (`Search.device_draw`). Then: the groups that decide together
    (`Search.group_key`, with `grouping`), (strategy, key) -> (slot positions,
    their first rows, their searches); and the drawing members, (slot position, its
    draws with rows of the batch), in slot order."""
    if not room or not use_top_candidates:
        return None
    groups: dict[tuple, tuple[list[int], list[int], list[Search]]] = {}
    draws: list[tuple[int, SampleDraws]] = []
    row = 0
    for position, member in enumerate(slots):
        search = member.search
        if not isinstance(search, Retired):
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


def decide_groups(groups: Groups, ids: np.ndarray, log_probs: np.ndarray
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


def candidates(out: StepOutput, banned: np.ndarray | None
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


def next_rows(pieces: list[tuple[Any, np.ndarray, np.ndarray]],
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


def joined_draws(drawing: list[tuple[int, SampleDraws]], banned: np.ndarray | None
                  ) -> SampleDraws:
    """The drawing members' draws as one request [S] (member by member), with the bans
    of the batch's candidates and whole rows (`banned`)."""
    parts = [part for _, part in drawing]
    return SampleDraws(*(np.concatenate([getattr(part, name) for part in parts])
                         for name in ("rows", "uniforms", "temperature", "top_k", "top_p",
                                      "block_eos")),
                       eos_token_id=parts[0].eos_token_id, banned=banned)
