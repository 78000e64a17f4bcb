"""Sampling without top-k drawn on the device (`tfserve.runtime.sampling_graph`), against the
host's draw from whole logits rows (`SamplingSearch.advance`): with the same seed, the same
tokens and, to float32 rounding, the same scores; and no logits row crosses to the host.

The device placement runs here on CPU OrtValues (`Runtime(..., device_cache=True)`), as the
runtime tests check it without a GPU."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from fake_backend import EOS, PAD
from schedules import Request, run
from test_sampling_candidates import same_events

from tests.exported import artifacts
from tests.waves import sources
from tfserve.bench.step_profile import search_profile
from tfserve.generation import DecodingOptions, Hypothesis, make_search, score_rows
from tfserve.generation.batch import BatchRunError, DecodeBatch, generate
from tfserve.generation.sampling import SamplingSearch
from tfserve.runtime import Runtime, sessions
from tfserve.runtime.providers import make_session
from tfserve.runtime.sampling_graph import (
    DRAW_OUTPUTS,
    STEP_DRAW_INPUTS,
    DeviceSampler,
    draw_feeds,
    moved_bytes,
)
from tfserve.runtime.step_graph import CACHE_ROWS, rewritten_decoder
from tfserve.step import SampleDraws

BANNED = np.array([PAD], np.int64)


def sampling(**fields: Any) -> DecodingOptions:
    return DecodingOptions(do_sample=True, **fields).validate(100)


def step_counter(runtime: Runtime) -> list[bool]:
    """need_logits of each of the runtime's steps from now on."""
    asked: list[bool] = []
    step = runtime.step
    runtime.step = lambda *args, **kwargs: (  # type: ignore[method-assign]
        asked.append(kwargs.get("need_logits", True)) or step(*args, **kwargs))
    return asked


def same_hypotheses(got: list[list[Hypothesis]], want: list[list[Hypothesis]]) -> None:
    assert [[h.token_ids for h in r] for r in got] == [[h.token_ids for h in r] for r in want]
    assert [[h.finished for h in r] for r in got] == [[h.finished for h in r] for r in want]
    np.testing.assert_allclose([h.score for r in got for h in r],
                               [h.score for r in want for h in r], rtol=0, atol=1e-5)


# -- the draw graph against the search's own draw, on random rows ------------------------------


@pytest.mark.parametrize("logits_dtype", [np.float32, np.float16])
def test_the_device_draw_is_the_searchs_whole_row_draw(logits_dtype: type) -> None:
    """Searches with every kind of option (temperature, top-k narrower and wider than the
    row, top-p, eos blocked or not, samples fanning out) step over random rows with ties:
    drawing through the graph gives each the tokens, samples and scores of its own draw."""
    rng = np.random.default_rng(0)
    vocab, steps = 300, 6
    sampler = DeviceSampler("cpu", 0, ["CPUExecutionProvider"])
    for case in range(24):
        options = sampling(seed=case, max_new_tokens=steps, min_new_tokens=int(rng.integers(4)),
                           temperature=float(rng.choice([1.0, 0.6, 1.7])),
                           top_k=int(rng.choice([0, 0, 5, 120, 400])),
                           top_p=float(rng.choice([1.0, 1.0, 0.9, 0.3])),
                           num_return_sequences=int(rng.integers(1, 4)))
        host, device = (make_search(options, EOS, PAD) for _ in range(2))
        while not host.done:
            # [rows,1,V] as the decoder gives them; a run of equal logits makes ties
            logits = (rng.standard_normal((host.rows, 1, vocab)) * 3).astype(logits_dtype)
            logits[:, :, 10:20] = logits[:, :, 10:11]
            rows = logits[:, -1, :].astype(np.float32)  # [rows,V] what the host reads
            lse, _ = score_rows(rows, BANNED, 0)  # bans pad, as the batch does
            host_next = host.advance(rows, lse)
            draws = device.device_draw()
            assert draws is not None
            tokens, log_probs = sampler.draw(ort.OrtValue.ortvalue_from_numpy(logits),
                                             draws._replace(banned=BANNED))
            device_next = device.advance_drawn(tokens, log_probs)
            for got, want in zip(device_next, host_next):
                np.testing.assert_array_equal(got, want)
            assert device.samples == host.samples and device.streamed == host.streamed
            np.testing.assert_allclose(device.scores, host.scores, rtol=0, atol=1e-5)
            device.rows = host.rows = len(host_next[0])
        assert device.done
        assert [(h.token_ids, h.finished) for h in device.results()] == \
               [(h.token_ids, h.finished) for h in host.results()]


def test_device_draw_peeks_the_generator_and_advance_drawn_moves_it() -> None:
    """The uniforms a step's draws take come from the search's generator in the host's
    order, one per sample; asking twice (a failed run asked again) takes none."""
    search = make_search(sampling(seed=9, num_return_sequences=3), EOS, PAD)
    assert isinstance(search, SamplingSearch)
    first = search.device_draw()
    assert first is not None
    np.testing.assert_array_equal(search.device_draw().uniforms, first.uniforms)
    np.testing.assert_array_equal(first.uniforms, np.random.default_rng(9).random(3))
    np.testing.assert_array_equal(first.rows, [0, 0, 0])  # the fan-out: one row, 3 samples
    search.advance_drawn(np.array([5, 6, 7]), np.full(3, -1.0, np.float32))
    search.rows = 3
    second = search.device_draw()
    np.testing.assert_array_equal(second.rows, [0, 1, 2])
    np.testing.assert_array_equal(second.uniforms, np.random.default_rng(9).random(6)[3:])


def test_searches_that_read_rows_themselves_have_no_device_draw() -> None:
    controlled = make_search(sampling(seed=1, repetition_penalty=1.3), EOS, PAD)
    prefixed = make_search(sampling(seed=1, prefix_token_ids=(5,)), EOS, PAD)
    greedy = make_search(DecodingOptions().validate(100), EOS, PAD)
    assert controlled.device_draw() is None  # repetition controls act on whole rows
    assert prefixed.device_draw() is None  # a forced token: no draw
    assert greedy.device_draw() is None


# -- a real export, the device placement on CPU ------------------------------------------------


@pytest.mark.parametrize("options", [
    sampling(seed=3, max_new_tokens=12),
    sampling(seed=4, max_new_tokens=12, temperature=0.6),
    sampling(seed=5, max_new_tokens=12, top_p=0.8),
    sampling(seed=6, max_new_tokens=12, top_p=0.6, temperature=1.5, num_return_sequences=3),
    sampling(seed=7, max_new_tokens=12, top_k=50, top_p=0.95),  # top_k wider than the room
    sampling(seed=8, max_new_tokens=10, min_new_tokens=6, num_return_sequences=2),
], ids=["plain", "temperature", "top-p", "top-p-samples", "wide-top-k", "min-new-tokens"])
def test_device_draws_equal_the_host_whole_rows_with_no_logits_fetched(
        options: DecodingOptions) -> None:
    """Each step of the device placement is the decoder's run and the draw's, and brings
    back the graph's top candidates and the draws, nothing of vocabulary size; the samples
    and scores are the host placement's, which takes whole rows."""
    model = artifacts("sinusoidal", "pre", favour_specials=True)  # bans and eos matter
    host, device = Runtime(model), Runtime(model, device_cache=True)
    assert device.cache_storage.draws_on_device and not host.cache_storage.draws_on_device
    ids, mask = sources(host, [5, 3, 8, 4], seed=1)
    host_asked = step_counter(host)
    want = generate(host, ids, mask, options)
    assert host_asked and all(host_asked)  # the host placement: whole rows every step
    device_asked = step_counter(device)
    batch = DecodeBatch(device)
    searches = [make_search(options, device.eos_token_id, device.decoder_start_token_id)
                for _ in range(len(ids))]
    batch.add(searches, list(range(len(ids))), device.encode(ids, mask)[1], mask)
    got: list[list[Hypothesis]] = [[] for _ in searches]
    runs = []
    while len(batch):
        rows = batch.rows
        draws = sum(search.rows if search.fanned_out else options.num_return_sequences
                    for search in (member.search for member in batch.members))
        before = device.counters.snapshot()
        for tag, search in batch.step():
            got[tag] = search.results()
        moved = device.counters.since(before)
        runs.append(moved.runs)
        # back: each row's K candidates (int64 id, float32 log-probability), each draw's
        # token (int64) and log-probability (float32); never the [R,V] logits
        assert moved.to_host == rows * device.top_candidates * 12 + draws * 12
        assert moved.to_host < rows * device.vocab_size * 4 + draws * 12
    assert device_asked and not any(device_asked)
    # the decoder's run, which makes the draws too (and, where rows leave, row operations)
    assert min(runs) == 1, runs
    same_hypotheses(got, want)


def sampling_schedule(seed: int) -> list[Request]:
    """Searches joining a batch at random steps, some cancelled: most sample without a
    top-k the candidates serve (drawn on the device), beside greedy, beam and top-k
    sampling searches that decide from the candidates."""
    rng = random.Random(seed)
    requests = []
    for index in range(rng.randint(6, 10)):
        max_new = rng.randint(1, 12)
        kind = rng.choice(["draw", "draw", "draw", "top-k", "greedy", "beam"])
        fields: dict[str, Any] = dict(max_new_tokens=max_new,
                                      min_new_tokens=rng.randint(0, min(max_new, 4)))
        if kind == "draw":
            fields.update(do_sample=True, seed=seed * 100 + index,
                          top_k=rng.choice([0, 0, 60]), top_p=rng.choice([1.0, 0.9, 0.5]),
                          temperature=rng.choice([1.0, 0.7, 1.6]),
                          num_return_sequences=rng.randint(1, 3))
        elif kind == "top-k":
            fields.update(do_sample=True, seed=seed * 100 + index, top_k=rng.randint(2, 8))
        elif kind == "beam":
            fields.update(num_beams=rng.randint(2, 3))
        options = DecodingOptions(**fields).validate(63)
        source = tuple(rng.randint(3, 110) for _ in range(rng.randint(1, 6))) + (EOS,)
        join = rng.randint(0, 8)
        cancel = join + rng.randint(0, 5) if rng.random() < 0.2 else None
        requests.append(Request(join, source, options, cancel))
    return requests


@pytest.mark.parametrize("seed", range(4))
def test_a_running_batch_draws_on_the_device_as_the_host_draws(seed: int) -> None:
    """Rows joining mid-decode and cancelled between steps, every strategy in one batch:
    the device placement (draws on the device, no step fetching logits) gives the events of
    the host placement (whole rows) in the same order."""
    model = artifacts("rope", "pre")
    assert (EOS, PAD) == (Runtime(model).eos_token_id, Runtime(model).pad_token_id)
    requests = sampling_schedule(seed)
    host = Runtime(model)
    want = run(requests, host)
    device = Runtime(model, device_cache=True)
    asked = step_counter(device)
    got = run(requests, device)
    same_events(got, want)
    assert asked and not any(asked)


def test_repetition_controls_keep_whole_rows_for_the_step() -> None:
    """A search with repetition controls reads whole rows: its steps fetch the logits, and
    the sampling searches beside it draw from them on the host, as before."""
    model = artifacts("rope", "pre")
    device = Runtime(model, device_cache=True)
    requests = [Request(0, (5, 6, 7, EOS), sampling(seed=1, max_new_tokens=8), None),
                Request(0, (8, 9, EOS), sampling(seed=2, max_new_tokens=8,
                                                 repetition_penalty=1.4), None)]
    asked = step_counter(device)
    got = run(requests, device)
    same_events(got, run(requests, Runtime(model)))
    assert asked and all(asked)


def test_a_failed_step_leaves_the_draws_to_be_made_again() -> None:
    """A step whose run fails changes no search (the uniforms were only peeked): stepped
    again, the batch gives what it gives without the failure."""
    model = artifacts("rope", "pre")
    options = sampling(seed=12, max_new_tokens=6, top_p=0.9, num_return_sequences=2)
    ids, mask = sources(Runtime(model), [4, 6], seed=3)
    want = generate(Runtime(model), ids, mask, options)
    device = Runtime(model, device_cache=True)
    batch = DecodeBatch(device)
    searches = [make_search(options, device.eos_token_id, device.decoder_start_token_id)
                for _ in range(2)]
    batch.add(searches, [0, 1], device.encode(ids, mask)[1], mask)
    batch.step()
    step = device.step
    device.step = lambda *args, **kwargs: (  # type: ignore[method-assign]
        1 / 0 if kwargs.get("draws") is not None else step(*args, **kwargs))
    with pytest.raises(BatchRunError):
        batch.step()
    device.step = step  # type: ignore[method-assign]
    got: list[list[Hypothesis]] = [[], []]
    while len(batch):
        for tag, search in batch.step():
            got[tag] = search.results()
    same_hypotheses(got, want)


def test_step_profile_reports_the_sampling_steps_bytes() -> None:
    model = artifacts("rope", "pre")
    row = search_profile(model, batch=4, beams=1, source=5, steps=3, threads=1,
                         placement="device", sampling={"top_p": 0.9, "temperature": 0.8})
    runtime = Runtime(model)
    assert row["runs_per_step"] == 1  # the decoder's run, which draws
    # the top candidates and the draws: 4 x 34 x 12 + 4 x 12 bytes, no logits
    assert row["to_host_bytes_per_step"] == 4 * runtime.top_candidates * 12 + 4 * 12


def test_the_draws_of_several_searches_join_in_slot_order() -> None:
    """DecodeBatch hands the backend one SampleDraws, member by member, rows of the batch."""
    model = artifacts("rope", "pre")
    device = Runtime(model, device_cache=True)
    seen: list[SampleDraws] = []
    step = device.step
    device.step = lambda *args, **kwargs: (  # type: ignore[method-assign]
        kwargs.get("draws") is not None and seen.append(kwargs["draws"])) or step(*args, **kwargs)
    ids, mask = sources(device, [3, 4, 5], seed=4)
    options = [sampling(seed=1, max_new_tokens=3, min_new_tokens=3, num_return_sequences=2),
               DecodingOptions(max_new_tokens=3, min_new_tokens=3).validate(100),
               sampling(seed=2, max_new_tokens=3, min_new_tokens=1, temperature=0.5)]
    batch = DecodeBatch(device)
    batch.add([make_search(o, device.eos_token_id, device.decoder_start_token_id)
               for o in options], [0, 1, 2], device.encode(ids, mask)[1], mask)
    batch.step()
    batch.step()
    first, second = seen
    np.testing.assert_array_equal(first.rows, [0, 0, 2])  # two samples of row 0; row 2
    np.testing.assert_array_equal(second.rows, [0, 1, 3])  # rows 0-1 the samples, 2 greedy
    np.testing.assert_array_equal(second.temperature, np.float32([1.0, 1.0, 0.5]))
    np.testing.assert_array_equal(second.block_eos, [True, True, False])
    np.testing.assert_array_equal(second.banned, [PAD])


# -- the draws inside the decoder step's run ---------------------------------------------------


def standalone_draws(monkeypatch: pytest.MonkeyPatch, model: Any) -> Runtime:
    """A device placement whose decoder graph has no draw: the step keeps its logits and a
    second run draws from them (the fallback of a graph without the draw)."""
    with monkeypatch.context() as patch:
        patch.setattr(sessions, "rewritten_decoder",
                      lambda path, past, draws_from=None: rewritten_decoder(path, past))
        patch.setattr(sessions, "STEP_DRAW_INPUTS", ())
        return Runtime(model, device_cache=True)


def test_a_sampling_step_is_one_run_moving_what_the_draw_run_moved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Searches sampling with temperature, top-p, a top-k wider than the candidates, two
    samples each (every search the same rows: no per-row copy of the cross K/V), eos
    blocked to their last step (no row leaves before): every step is the decoder's one run,
    which makes the draws; the bytes each step moves, the tokens and the scores are those
    of the decoder's run followed by the standalone draw run."""
    model = artifacts("sinusoidal", "pre", favour_specials=True)
    fused = Runtime(model, device_cache=True)
    assert {value.name for value in fused.decoder.get_inputs()} >= set(STEP_DRAW_INPUTS)
    apart = standalone_draws(monkeypatch, model)
    assert not {value.name for value in apart.decoder.get_inputs()} & set(STEP_DRAW_INPUTS)
    steady = dict(max_new_tokens=7, min_new_tokens=7, num_return_sequences=2)
    options = [sampling(seed=21, temperature=0.7, **steady),
               sampling(seed=22, top_p=0.8, **steady),
               sampling(seed=23, top_k=60, top_p=0.9, temperature=1.4, **steady)]
    ids, mask = sources(fused, [4, 6, 3], seed=5)
    steps: dict[str, list[Any]] = {}
    results: dict[str, list[list[Hypothesis]]] = {}
    for name, runtime in (("fused", fused), ("apart", apart)):
        batch = DecodeBatch(runtime)
        batch.add([make_search(o, runtime.eos_token_id, runtime.decoder_start_token_id)
                   for o in options], [0, 1, 2], runtime.encode(ids, mask)[1], mask)
        got: list[list[Hypothesis]] = [[], [], []]
        moved = steps[name] = []
        while len(batch):
            before = runtime.counters.snapshot()
            for tag, search in batch.step():
                got[tag] = search.results()
            moved.append(runtime.counters.since(before))
        results[name] = got
    assert [m.runs for m in steps["fused"]] == [1] * 7
    assert [m.runs for m in steps["apart"]] == [2] * 7
    assert [(m.to_device, m.to_host) for m in steps["fused"]] == \
           [(m.to_device, m.to_host) for m in steps["apart"]]
    same_hypotheses(results["fused"], results["apart"])
    assert [[h.score for h in r] for r in results["fused"]] == \
           [[h.score for h in r] for r in results["apart"]]  # the same nodes: exactly


def decoder_feeds(runtime: Runtime, rows: int) -> dict[str, np.ndarray]:
    """A first step's inputs for `rows` random sources (host arrays), cache_rows included."""
    ids, mask = sources(runtime, [3 + row for row in range(rows)], seed=6)
    _, cross = runtime.encode(ids, mask)
    feeds = {"input_ids": np.full((rows, 1), runtime.decoder_start_token_id, np.int64),
             "position_ids": np.zeros((rows, 1), np.int64),  # [B,1]
             "self_attention_mask": np.ones((rows, 1), np.int64),  # [B,1]
             "encoder_attention_mask": mask, CACHE_ROWS: np.arange(rows, dtype=np.int64)}
    past = runtime.empty_past(rows)
    feeds.update(zip(runtime._past_names, (np.asarray(tensor) for tensor in past)))
    feeds.update(zip(runtime._cross_names, (np.asarray(tensor) for tensor in cross)))
    return feeds


def test_a_step_without_draws_gives_what_the_graph_without_the_draw_gives() -> None:
    """The decoder graph with the draw, run without draws (the If off, empty inputs), gives
    every output of the graph without it, exactly, and empty draws; run with draws, the
    same outputs and the standalone draw graph's tokens on its logits."""
    runtime = Runtime(artifacts("rope", "pre"))
    path = runtime.directory / runtime.manifest.decoder_file
    plain = make_session(path, model=rewritten_decoder(path, runtime._past_names))
    drawing = make_session(path, model=rewritten_decoder(path, runtime._past_names,
                                                         "logits"))
    feeds = decoder_feeds(runtime, 3)
    names = [value.name for value in plain.get_outputs()]
    want = plain.run(names, feeds)
    empty = drawing.run(names + list(DRAW_OUTPUTS), {**feeds, **draw_feeds(None, 0)})
    for name, got, expected in zip(names, empty, want):
        np.testing.assert_array_equal(got, expected, err_msg=name)
    assert [value.shape for value in empty[len(names):]] == [(0,), (0,)]
    draws = SampleDraws(np.array([2, 0, 0]), np.array([0.3, 0.9, 0.5]),
                        np.float32([1.0, 0.7, 1.3]), np.array([0, 0, 40]),
                        np.float32([1.0, 0.8, 0.9]), np.array([True, False, True]),
                        runtime.eos_token_id, BANNED)
    drew = drawing.run(names + list(DRAW_OUTPUTS),
                       {**feeds, **draw_feeds(draws, runtime.vocab_size)})
    for name, got, expected in zip(names, drew, want):
        np.testing.assert_array_equal(got, expected, err_msg=name)
    sampler = DeviceSampler("cpu", 0, ["CPUExecutionProvider"])
    logits = ort.OrtValue.ortvalue_from_numpy(want[names.index("logits")])
    for got, expected in zip(drew[len(names):], sampler.draw(logits, draws)):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(("top_k", "top_p", "extra"), [
    ([0, 0], [1.0, 1.0], 0), ([0, 5], [1.0, 1.0], 8), ([0, 0], [0.9, 1.0], 4),
    ([300, 0], [1.0, 0.5], 4), ([7, 0], [0.5, 1.0], 12)])
def test_a_draw_sends_its_filters_options_only_when_their_pass_runs(
        top_k: list[int], top_p: list[float], extra: int) -> None:
    """Per draw its row, uniform and temperature (20 bytes), its banned ids and eos with
    their flags (9 bytes each); top_k (8) and top_p (4) only where some draw's filter
    runs (a top_k of V or more filters nothing); the If's conditions stay on the host."""
    draws = SampleDraws(np.array([0, 1]), np.array([0.5, 0.25]), np.float32([1.0, 0.5]),
                        np.array(top_k), np.float32(top_p), np.array([True, False]), EOS,
                        np.array([PAD, 7]))
    feeds = draw_feeds(draws, 300)
    assert moved_bytes(feeds) == 2 * (20 + 3 * 9 + extra)
    assert set(feeds) == set(STEP_DRAW_INPUTS)
    assert moved_bytes(draw_feeds(None, 300)) == 0
