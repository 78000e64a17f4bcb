"""Schedules of searches joining a DecodeBatch at given steps (some cancelled), run step by
step over a fake backend: every event in order, to compare two ways of deciding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from fake_backend import EOS, PAD

from tfserve.generation import Backend, DecodingOptions, make_search
from tfserve.generation.batch import DecodeBatch


@dataclass(frozen=True)
class Request:
    """One search of a schedule: the step it joins at, its source, its options, and the step
    it is cancelled at (None: it runs to its end)."""

    join: int
    source: tuple[int, ...]
    options: DecodingOptions
    cancel: int | None


def run(requests: list[Request], backend: Backend, group: bool = True,
        top_candidates: bool = True) -> list[Any]:
    """Every event of the schedule in order: each step's streamed tokens per member, each
    finished search's hypotheses (tokens, scores, finished), each cancelled search's tokens
    decided so far. group / top_candidates: DecodeBatch's group_decisions /
    use_top_candidates."""
    batch = DecodeBatch(backend, group_decisions=group, use_top_candidates=top_candidates)
    events: list[Any] = []
    step = 0
    while step <= max(r.join for r in requests) or len(batch):
        joining = [i for i, r in enumerate(requests) if r.join == step]
        if joining:
            width = max(len(requests[i].source) for i in joining)
            ids = np.full((len(joining), width), PAD, np.int64)  # [N,S]
            for row, i in enumerate(joining):
                ids[row, : len(requests[i].source)] = requests[i].source
            mask = (ids != PAD).astype(np.int64)
            searches = [make_search(requests[i].options, EOS, PAD) for i in joining]
            batch.add(searches, joining, backend.encode(ids, mask)[1], mask)
        cancelled = {m.tag for m in batch.members if requests[m.tag].cancel == step}
        for search in batch.remove(cancelled):
            events.append(("cancelled", search.generated, search.rows))
        if len(batch):
            members = list(batch.members)
            finished = batch.step()
            events.append([(m.tag, list(m.search.streamed)) for m in members])
            for tag, search in finished:
                assert search.error is None, search.error
                events.append((tag, [(h.token_ids, h.score, h.finished)
                                     for h in search.results()]))
        step += 1
    return events
