"""The group decisions (greedy and beam members decided together in a few numpy operations,
`Search.decide_group`) against the per-member reference path (`advance_candidates` of each,
DecodeBatch.group_decisions off): the same hypotheses, tokens and scores equal, the same
streamed tokens, for random mixes of searches joining and leaving a batch.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
from fake_backend import EOS, PAD, VOCAB, TopCandidatesBackend
from schedules import Request, run

from tfserve.generation import BeamSearch, DecodingOptions, GreedySearch, make_search
from tfserve.generation.batch import DecodeBatch


def random_options(rng: random.Random, max_beams: int, controls: bool) -> DecodingOptions:
    """Greedy or beam options over the ranges the searches branch on."""
    max_new = rng.randint(1, 14)
    beams = 1 if rng.random() < 0.35 else rng.randint(2, max_beams)
    extra: dict[str, Any] = {}
    if rng.random() < 0.15:
        extra["prefix_token_ids"] = tuple(rng.choice(range(2, VOCAB)) for _ in range(
            rng.randint(1, 2)))
        extra["prefix_counts_as_new"] = rng.random() < 0.5
        if extra["prefix_counts_as_new"]:
            max_new = max(max_new, len(extra["prefix_token_ids"]))
    if rng.random() < 0.15:
        extra["forced_eos"] = True
    if controls and rng.random() < 0.1:
        extra["repetition_penalty"] = 1.3
    return DecodingOptions(
        max_new_tokens=max_new, min_new_tokens=rng.randint(0, min(max_new, 5)),
        num_beams=beams, num_return_sequences=rng.randint(1, beams),
        early_stopping=rng.choice([False, True, "never"]),
        length_penalty=rng.choice([1.0, 0.5, 2.0, -0.7]), **extra,
    ).validate(63, vocab_size=VOCAB, eos_token_id=EOS)


def random_schedule(seed: int, max_beams: int, controls: bool) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(rng.randint(6, 14)):
        source = tuple(rng.randint(2, VOCAB - 1) for _ in range(rng.randint(1, 6))) + (EOS,)
        join = rng.randint(0, 12)
        cancel = join + rng.randint(0, 6) if rng.random() < 0.15 else None
        requests.append(Request(join, source, random_options(rng, max_beams, controls), cancel))
    return requests


@pytest.fixture
def group_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each strategy's decide_group ran."""
    calls = {"greedy": 0, "beam": 0}
    for name, strategy in (("greedy", GreedySearch), ("beam", BeamSearch)):
        original = strategy.decide_group.__func__  # type: ignore[attr-defined]

        def counted(cls: Any, *args: Any, _name: str = name, _original: Any = original) -> Any:
            calls[_name] += 1
            return _original(cls, *args)

        monkeypatch.setattr(strategy, "decide_group", classmethod(counted))
    return calls


BACKENDS = {
    # K < V: num_beams up to 3 fit beside eos and pad (2 * 3 + 2 = 8); the ranking cut
    # (2 * num_beams + 2 columns) applies to num_beams 1 and 2
    "k8": dict(top_candidates=8),
    # K = V: every token a candidate, any num_beams; many equal scores (the tie rule)
    "k16-ties": dict(top_candidates=16, ties=True),
    # several banned ids: rows with few finite candidates
    "k12-banned": dict(top_candidates=12, banned_token_ids=(0, 4, 9, 13)),
}


@pytest.mark.parametrize("backend_kind", list(BACKENDS))
@pytest.mark.parametrize("seed", range(12))
def test_group_decisions_equal_the_per_member_path(backend_kind: str, seed: int,
                                                   group_calls: dict[str, int]) -> None:
    """Random greedy / beam mixes joining at random steps and some cancelled: the same
    events, hypotheses (tokens and scores, exactly) and streamed tokens on both paths."""
    settings = BACKENDS[backend_kind]
    max_beams = 3 if settings["top_candidates"] == 8 else (
        4 if backend_kind == "k12-banned" else 6)
    # repetition controls (whole logits rows for every member, that step) in half the runs
    requests = random_schedule(seed, max_beams, controls=seed % 2 == 1)
    reference = run(requests, TopCandidatesBackend(**settings), group=False)
    assert group_calls == {"greedy": 0, "beam": 0}
    grouped = run(requests, TopCandidatesBackend(**settings), group=True)
    assert grouped == reference
    assert group_calls["greedy"] + group_calls["beam"] > 0


def crafted(rng: np.random.Generator, rows: int, k: int, eos: int) -> tuple[np.ndarray, ...]:
    """Candidates ids, log_probs [rows,k]: distinct ids per row in no order of score, eos
    among them often, -inf entries (banned) and scores from a small set (ties)."""
    ids = np.stack([rng.choice(VOCAB, k, replace=False) for _ in range(rows)])  # [rows,k]
    log_probs = -rng.choice([0.25, 0.5, 1.0, 1.5, 3.0], (rows, k)).astype(np.float32)
    log_probs[rng.random((rows, k)) < 0.25] = -np.inf
    if rng.random() < 0.5:
        log_probs[ids == eos] = np.float32(-0.25)
    return ids, log_probs


@pytest.mark.parametrize("num_beams", [2, 3, 5])
def test_beam_group_decision_equals_select(num_beams: int) -> None:
    """BeamSearch.decide_group + take_decision leave each search as advance_candidates
    does (rows, tokens, sums, finished hypotheses, done), on crafted candidates with ties,
    -inf scores, eos ranked anywhere and rows with fewer than num_beams continuations."""
    rng = np.random.default_rng(num_beams)
    for trial in range(40):
        options = [DecodingOptions(
            num_beams=num_beams, max_new_tokens=int(rng.integers(2, 9)),
            min_new_tokens=int(rng.integers(0, 3)),
            num_return_sequences=int(rng.integers(1, num_beams + 1)),
            early_stopping=[False, True, "never"][trial % 3],
            length_penalty=float(rng.choice([1.0, 0.5, -1.0]))).validate(63)
            for _ in range(4)]
        grouped = [make_search(o, EOS, PAD) for o in options]
        alone = copy.deepcopy(grouped)
        while grouped:
            rows = len(grouped[0].beam_scores)  # type: ignore[attr-defined]
            same = [i for i, s in enumerate(grouped)
                    if s.group_key() == grouped[0].group_key()]
            k = int(rng.integers(2, 15))  # above 2 * num_beams + 2: the ranking cut applies
            ids, log_probs = crafted(rng, rows * len(same), k, EOS)
            decision = BeamSearch.decide_group([grouped[i] for i in same], ids, log_probs)
            for part, i in enumerate(same):
                block = slice(part * rows, (part + 1) * rows)
                parents, tokens = alone[i].advance_candidates(ids[block], log_probs[block])
                grouped[i].take_decision(decision, part)
                start, stop = decision.bounds[part], decision.bounds[part + 1]
                ours, theirs = grouped[i], alone[i]
                assert ours.done == theirs.done
                if not ours.done:
                    assert decision.parents[start:stop].tolist() == (
                        parents + part * rows).tolist()
                    assert decision.tokens[start:stop].tolist() == tokens.tolist()
                assert ours.beams == theirs.beams  # type: ignore[attr-defined]
                assert ours.beam_scores.tolist() == theirs.beam_scores.tolist()  # type: ignore[attr-defined]
                assert [(h.token_ids, h.score, h.finished) for h in ours.finished] == [
                    (h.token_ids, h.score, h.finished) for h in theirs.finished]
            keep = [i for i, s in enumerate(grouped) if not s.done]
            grouped, alone = [grouped[i] for i in keep], [alone[i] for i in keep]


def test_beam_histories_follow_the_beams() -> None:
    """histories() (what repetition controls read), kept from step to step, equals the
    beams' tokens after the start token, also when asked only every other step."""
    rng = np.random.default_rng(7)
    search = make_search(DecodingOptions(num_beams=3, max_new_tokens=12).validate(63), EOS, 5)
    asked = 0
    while not search.done:
        rows = len(search.beam_scores)  # type: ignore[attr-defined]
        ids = np.stack([rng.choice(np.arange(2, VOCAB), 6, replace=False) for _ in range(rows)])
        log_probs = -rng.random((rows, 6)).astype(np.float32)
        search.advance_candidates(ids, log_probs)
        asked += 1
        if search.done or asked % 2:
            continue
        expected = [[5, *beam] for beam in search.beams]  # type: ignore[attr-defined]
        assert search.histories().tolist() == expected
    assert asked == 12


def decode(options: list[DecodingOptions], poisoned: int | None = None,
           group: bool = True) -> list[Any]:
    """Sources 3, 4, ... decoded together with these options (a greedy or beam search each);
    `poisoned`: the index of a search whose part of a group decision raises. Returns each
    search's hypotheses, or its error."""
    backend = TopCandidatesBackend(top_candidates=8)
    ids = np.array([[3 + i, 5, EOS] for i in range(len(options))], np.int64)  # [N,3]
    mask = np.ones_like(ids)
    searches = [make_search(o.validate(63), EOS, PAD) for o in options]
    if poisoned is not None:
        def take_decision(*args: Any) -> None:
            raise ZeroDivisionError("float division by zero")

        searches[poisoned].take_decision = take_decision  # type: ignore[method-assign]
    batch = DecodeBatch(backend, group_decisions=group)
    batch.add(searches, list(range(len(options))), backend.encode(ids, mask)[1], mask)
    outcome: list[Any] = [None] * len(options)
    while len(batch):
        for tag, search in batch.step():
            outcome[tag] = (type(search.error) if search.error is not None else
                            [(h.token_ids, h.score) for h in search.results()])
    return outcome


MIX = [DecodingOptions(max_new_tokens=9), DecodingOptions(num_beams=3, max_new_tokens=9),
       DecodingOptions(max_new_tokens=9, min_new_tokens=4),
       DecodingOptions(num_beams=3, max_new_tokens=9, num_return_sequences=2)]


def test_a_search_that_raises_in_a_group_decision_fails_alone() -> None:
    """A search whose part of its group's decision raises ends with that error; the others
    (in its group and not) get the answers of the per-member path."""
    reference = decode(MIX, group=False)
    for poisoned in (0, 1):
        outcome = decode(MIX, poisoned=poisoned)
        assert outcome[poisoned] is ZeroDivisionError
        assert [o for i, o in enumerate(outcome) if i != poisoned] == [
            o for i, o in enumerate(reference) if i != poisoned]


def test_a_group_decision_that_raises_leaves_its_members_to_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When a strategy's decide_group raises, its members decide through their own
    advance_candidates that step: the same answers."""
    def broken(cls: Any, *args: Any) -> Any:
        raise RuntimeError("no group decision")

    monkeypatch.setattr(BeamSearch, "decide_group", classmethod(broken))
    assert decode(MIX) == decode(MIX, group=False)
