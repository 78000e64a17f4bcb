"""Continuous batching: the rows of many searches decoded together, one token per step.

`DecodeBatch` is the one decoding loop (the server's scheduler and offline `generate` both
run it). Between two steps, searches that finished retire and new ones join, which the
per-row `position_ids` and `self_attention_mask` of the decoder interface make possible: a
row that joins late has holes (mask 0) where the others have history. Three parts, the way
vLLM separates its input batch from the runner and the sampler:

- `batch_rows.BatchRows`: the rows and their layout (joining, leaving, retiring, compaction,
  a beam step's reorder done or left pending for the next step);
- `batch_decisions`: what a step decides with (the plan, group decisions, candidates with
  the bans, the draws joined, the next rows in slot order);
- here: the step, through the step contract (`tfserve.step`: `Backend.step` with the
  pending `parents` and the members' `draws`), with its fault isolation (a search that
  raises fails alone; a failed run leaves the batch as it was, and `run_alone` finds the
  member the model cannot take).

A step fetches the [R,V] logits only when some member reads whole rows itself. Members
decide from the backend's top candidates where those serve them (greedy, beam, top-k
sampling); a sampling member that may draw any token has its draws made where the logits
were made, where the backend takes draws in its step (`Search.device_draw`, `SampleDraws`),
so that a step of such members moves nothing of vocabulary size either. Repetition controls
read whole rows: a step with such a member fetches them. The searches themselves and the
step contract are in `tfserve.generation` and `tfserve.step`; nothing here names a
placement, a cache storage or a graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any

import numpy as np

from tfserve.generation.backend import Backend, SampleDraws, StepOutput
from tfserve.generation.batch_decisions import (
    bans,
    bans_source,
    candidates,
    decide_groups,
    joined_draws,
    next_rows,
)
from tfserve.generation.batch_decisions import plan as decisions_plan
from tfserve.generation.batch_rows import BatchRows, Joining, Member, Retired
from tfserve.generation.kernels import score_rows
from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.generation.search import Search, make_search

__all__ = ["BatchRunError", "DecodeBatch", "Joining", "generate"]


class BatchRunError(RuntimeError):
    """The decoder run of a step failed; the batch is as it was before the step."""


@dataclass
class DecodeBatch(BatchRows):
    """Rows of many searches decoded together, one token per step (`BatchRows`: the rows
    and their layout; here: the step and its decisions)."""

    # decide greedy and beam rows from the backend's top candidates when it has them (off:
    # always from the full logits; both give the same tokens, see tests/runtime/test_runtime.py)
    use_top_candidates: bool = True
    # decide the members that decide from top candidates together, strategy by strategy, in
    # a few numpy operations over all their rows (`Search.decide_group`). Off: each member
    # through its own `advance_candidates`, the reference path (both give the same tokens and
    # scores: tests/generation/test_vectorised_search.py; bench.search_overhead times both)
    group_decisions: bool = True
    # (what the backend's bans were read from, the banned ids [n] or None, the candidates per
    # row left for a search's own): batch_decisions.bans once per backend state
    _bans: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def step(self) -> list[tuple[Any, Search]]:
        """Run one decoder step for every row; returns the members that finished.

        A search that raises while it decides its tokens finishes too, with `search.error`
        set: it fails alone, and the other rows' step goes on. An exception from here (the
        backend's run, a cache copy) belongs to the whole batch.
        """
        if all(isinstance(member.search, Retired) for member in self.slots):
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
        plan = decisions_plan(self.slots, room, getattr(self.backend, "draws_in_step", False),
                              self.group_decisions, self.use_top_candidates)
        from_top = plan is not None
        groups, drawing = plan if plan is not None else (None, [])
        draws = joined_draws(drawing, banned) if drawing else None
        out = self._run(cross, encoder_attention_mask, self_attention_mask, from_top, draws)
        # [S] each: the drawing members' tokens and log-probabilities, member by member
        drawn = None if draws is None else (out.drawn_ids, out.drawn_log_probs)
        self.steps += 1
        self.past, self.pending_parents = out.present, None
        self.self_attention_mask = self_attention_mask
        # the model's banned tokens (the checkpoint's bad_words_ids, from model.json; pad for
        # older exports) go to -inf after the normaliser is taken, without renormalising: the
        # scores then equal transformers' with those bad_words_ids
        pad = self.backend.pad_token_id
        top = candidates(out, banned) if from_top else None
        if top is None:
            # [R,V]; the backend hands over a fresh array, so score_rows edits it in place;
            # beam candidates of every row come from one threaded pass
            logits = out.logits[:, -1, :].astype(np.float32, copy=False)
            beam_k = max((m.search.candidates_per_row() for m in self.slots), default=0)
            lse, best = score_rows(logits, banned, beam_k)  # [R], [R,k]
        starts = list(accumulate((m.search.rows for m in self.slots), initial=0))  # [M+1]
        decisions = decide_groups(groups, *top) if groups else []
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
            if isinstance(search, Retired):
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
                self.slots[position] = member = Member(Retired(rows, pad, self.steps), None)
                parents, new_tokens = member.search.parents, member.search.last_tokens
                retired.append(np.arange(row, row + rows))
            pieces.append((position, parents + row, new_tokens))
        index, last_tokens = next_rows(pieces, decisions, ended)  # old row per row
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

    def _run(self, cross: Any, encoder_attention_mask: np.ndarray,
             self_attention_mask: np.ndarray, from_top: bool, draws: SampleDraws | None
             ) -> StepOutput:
        """The step's one call of the backend, through the step contract: the reorder left
        pending and the draws go with it, and the backend honours them its own way. A
        failure belongs to the whole batch (BatchRunError) and leaves it as it was."""
        try:
            out = self.backend.step(
                self.last_tokens[:, None],  # [R,1]
                self.position_ids[:, None],  # [R,1]
                self_attention_mask,
                encoder_attention_mask,
                self.past,
                cross,
                **({"need_logits": False} if from_top else {}),
                **({"parents": self.pending_parents} if self.pending_parents is not None
                   else {}),
                **({"draws": draws} if draws is not None else {}),
            )
        except Exception as exc:  # nothing has changed yet: the batch can be stepped again
            raise BatchRunError(f"decoder run failed: {exc}") from exc
        if from_top and (out.top_ids is None or out.top_log_probs is None):
            raise BatchRunError("the backend declares top candidates, but its step gave none")
        if draws is not None and (out.drawn_ids is None or out.drawn_log_probs is None):
            raise BatchRunError("the backend takes draws in its step, but its step gave none")
        return out

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
                backend.take_rows(self.past, index if self.pending_parents is None
                                  else self.pending_parents[index]),
                backend.take_rows(self.cross, member_rows),
            )
        except Exception as exc:
            return exc
        return None

    def _banned(self) -> tuple:
        """`batch_decisions.bans` of the backend, read again only when its state changed."""
        if self._bans is None or self._bans[0] != bans_source(self.backend):
            self._bans = bans(self.backend)
        return self._bans


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
