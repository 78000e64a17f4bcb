"""Top-k sampling decided from each row's best candidates (`SamplingSearch.advance_candidates`,
no logits row leaving the backend) against the whole-row path (`advance`): with the same
seed, the same samples, streamed tokens and scores, for schedules of searches joining and
leaving a batch."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from fake_backend import EOS, PAD, VOCAB, TopCandidatesBackend
from schedules import Request, run

from tfserve.generation import DecodingOptions, make_search
from tfserve.generation.sampling import SamplingSearch

# K = 8 candidates per row, eos and pad (banned) among them: room for top_k up to 6
TOP_CANDIDATES = 8


def sampling_schedule(seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for index in range(rng.randint(5, 10)):
        max_new = rng.randint(1, 12)
        options = DecodingOptions(
            do_sample=True, seed=seed * 100 + index, max_new_tokens=max_new,
            min_new_tokens=rng.randint(0, min(max_new, 4)),
            top_k=rng.randint(1, TOP_CANDIDATES - 2),
            top_p=rng.choice([1.0, 0.9, 0.6]), temperature=rng.choice([1.0, 0.7, 1.6]),
            num_return_sequences=rng.randint(1, 3),
        ).validate(63, vocab_size=VOCAB, eos_token_id=EOS)
        source = tuple(rng.randint(2, VOCAB - 1) for _ in range(rng.randint(1, 6))) + (EOS,)
        join = rng.randint(0, 8)
        cancel = join + rng.randint(0, 5) if rng.random() < 0.15 else None
        requests.append(Request(join, source, options, cancel))
    return requests


class CountingBackend(TopCandidatesBackend):
    """Counts the steps that asked for whole logits rows."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logits_steps = 0
        self.steps = 0

    def step(self, *args: Any, need_logits: bool = True, **kwargs: Any) -> Any:
        self.steps += 1
        self.logits_steps += need_logits
        return super().step(*args, need_logits=need_logits, **kwargs)


def same_events(candidates: list[Any], rows: list[Any]) -> None:
    """Equal events; scores equal to float32 rounding (the two paths normalise apart)."""
    assert len(candidates) == len(rows)
    for got, want in zip(candidates, rows):
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list) \
                and got[1] and isinstance(got[1][0], tuple):
            assert got[0] == want[0]
            assert [(t, f) for t, _, f in got[1]] == [(t, f) for t, _, f in want[1]]
            np.testing.assert_allclose([s for _, s, _ in got[1]], [s for _, s, _ in want[1]],
                                       rtol=1e-5, atol=1e-5)
        else:
            assert got == want


@pytest.mark.parametrize("seed", range(10))
def test_top_k_samples_from_candidates_equal_the_whole_row(seed: int) -> None:
    requests = sampling_schedule(seed)
    whole = CountingBackend(top_candidates=TOP_CANDIDATES)
    rows = run(requests, whole, top_candidates=False)
    backend = CountingBackend(top_candidates=TOP_CANDIDATES)
    candidates = run(requests, backend)
    same_events(candidates, rows)
    assert whole.logits_steps == whole.steps  # the reference took whole rows every step
    assert backend.logits_steps == 0  # and this one none


def test_without_top_k_or_with_more_than_the_candidates_whole_rows_are_used() -> None:
    search = make_search(DecodingOptions(do_sample=True, seed=1).validate(63), EOS, PAD)
    assert isinstance(search, SamplingSearch) and search.top_needed() == 0
    wide = make_search(DecodingOptions(do_sample=True, seed=1, top_k=7).validate(63), EOS, PAD)
    requests = [Request(0, (3, 4, EOS), wide.options, None)]
    backend = CountingBackend(top_candidates=TOP_CANDIDATES)
    run(requests, backend)
    assert backend.logits_steps == backend.steps > 0  # 7 > 6: no room beside eos and pad
