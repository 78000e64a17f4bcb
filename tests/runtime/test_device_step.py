"""The device placement's decoder step (what runs on CUDA), checked with CPU OrtValues: one ONNX
Runtime run per step, nothing of vocabulary size copied to the host, a beam step's cache
reorder inside the next step's run, and the host placement's tokens and scores throughout."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tests.exported import artifacts
from tests.waves import decode_waves, sources
from tfserve.generation import DecodingOptions, Hypothesis, make_search
from tfserve.generation.batch import DecodeBatch, generate
from tfserve.runtime import Runtime, sessions
from tfserve.runtime.step_graph import CACHE_ROWS, rewritten_decoder

MIXED = [
    DecodingOptions(max_new_tokens=9, num_beams=3, num_return_sequences=2),
    DecodingOptions(max_new_tokens=7),
    DecodingOptions(max_new_tokens=9, num_beams=4, length_penalty=0.6),
    DecodingOptions(max_new_tokens=6, do_sample=True, top_k=5, seed=3),
    DecodingOptions(max_new_tokens=8, num_beams=2, min_new_tokens=4),
    DecodingOptions(max_new_tokens=5, num_beams=3),
    DecodingOptions(max_new_tokens=9, num_beams=2, early_stopping=True),
]


def run_mixed(runtime: Runtime) -> tuple[dict[int, list[Hypothesis]], list[int]]:
    """Greedy, beam and sampling searches joining a running batch in three waves (the last
    while others are mid-decode, one cancelled): each source's hypotheses, and the runs of
    each step."""
    runs: list[int] = []
    results = decode_waves(runtime, MIXED, [5, 3, 8, 2, 6, 4, 7],
                           {0: [0, 1, 2], 2: [3, 4], 4: [5, 6]}, {5: 6}, seed=11, runs=runs)
    return results, runs


def test_the_device_step_gives_the_host_paths_hypotheses_in_one_run_per_step() -> None:
    """Rows joining, leaving and retiring, beams reordering: the device placement (its
    decoder rewritten with cache_rows) decodes what the host placement decodes, tokens and
    scores, and a step without a join or a compaction is one ONNX Runtime run."""
    host = Runtime(artifacts("rope", "pre"))
    device = Runtime(artifacts("rope", "pre"), device_cache=True)
    assert device.reorders_in_step and not host.reorders_in_step
    assert CACHE_ROWS in {value.name for value in device.decoder.get_inputs()}
    expected, _ = run_mixed(host)
    got, runs = run_mixed(device)
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3, 4, 5]
    for tag in expected:
        assert [h.token_ids for h in got[tag]] == [h.token_ids for h in expected[tag]], tag
        np.testing.assert_allclose([h.score for h in got[tag]],
                                   [h.score for h in expected[tag]], atol=1e-5, rtol=0)
    # beams reorder every step, yet a step whose rows neither join, leave nor change the
    # member layout (a search fanning out to its beams) is the decoder's run alone
    assert runs.count(1) >= 3, runs


def test_a_beam_step_moves_no_logits_between_host_and_device() -> None:
    """32 sources x 4 beams: each step copies ids, positions, masks and cache_rows to the
    device and the top candidates back, never the [R,V] logits."""
    runtime = Runtime(artifacts("rope", "pre"), device_cache=True)
    ids, mask = sources(runtime, [4] * 32, seed=5)
    steps = 6
    options = DecodingOptions(num_beams=4, max_new_tokens=steps,
                              min_new_tokens=steps).validate(100)
    batch = DecodeBatch(runtime)
    searches = [make_search(options, runtime.eos_token_id, runtime.decoder_start_token_id)
                for _ in range(32)]
    batch.add(searches, list(range(32)), runtime.encode(ids, mask)[1], mask)
    before = runtime.counters.snapshot()
    rows = []
    while len(batch):
        rows.append(batch.rows)
        batch.step()
    moved = runtime.counters.since(before)
    assert rows == [32] + [128] * (steps - 1) and moved.runs == steps
    # back to the host: each row's K candidate ids (int64) and log-probabilities (float32),
    # exactly; nothing of vocabulary size
    assert moved.to_host == sum(rows) * runtime.top_candidates * (8 + 4)
    # to the device: per row its token, position, cache row and mask columns (int64)
    assert moved.to_device < sum(rows) * 8 * (3 + 2 * (steps + ids.shape[1]))


def test_need_logits_false_gives_the_same_candidates_without_logits() -> None:
    for device_cache in (False, True):
        runtime = Runtime(artifacts("sinusoidal", "pre"), device_cache=device_cache)
        ids, mask = sources(runtime, [4, 6], seed=2)
        start = np.full((2, 1), runtime.decoder_start_token_id, np.int64)  # [2,1]
        args = (start, np.zeros((2, 1), np.int64), np.ones((2, 1), np.int64), mask)
        cross = runtime.encode(ids, mask)[1]
        full = runtime.step(*args, runtime.empty_past(2), cross)
        lean = runtime.step(*args, runtime.empty_past(2), cross, need_logits=False)
        assert full.logits is not None and lean.logits is None
        np.testing.assert_array_equal(full.top_ids, lean.top_ids)
        np.testing.assert_array_equal(full.top_log_probs, lean.top_log_probs)


def forced_fallback(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    """The device placement of a runtime that cannot rewrite the decoder at load (ONNX
    Runtime before 1.21, or without `onnx`), forced: the decoder graph as exported."""
    with monkeypatch.context() as patch:
        patch.setattr(sessions, "loads_rewritten_graphs", lambda: False)
        patch.setattr(sessions, "reads_graph_bytes", lambda: False)
        return Runtime(artifacts("rope", "pre"), device_cache=True)


@pytest.mark.parametrize("placement", ["device", "fallback", "host"])
def test_every_placement_honours_the_steps_parents(placement: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """step(past, parents=rows) equals step(take_rows(past, rows)): inside the step's run
    on the device placement (cache_rows), by a take run before it on the fallback, by a
    numpy gather on the host."""
    runtime = (forced_fallback(monkeypatch) if placement == "fallback"
               else Runtime(artifacts("rope", "pre"), device_cache=placement == "device"))
    assert runtime.reorders_in_step == (placement == "device")
    ids, mask = sources(runtime, [3, 5, 4], seed=8)
    _, cross = runtime.encode(ids, mask)
    start = np.full((3, 1), runtime.decoder_start_token_id, np.int64)  # [3,1]
    first = runtime.step(start, np.zeros((3, 1), np.int64), np.ones((3, 1), np.int64), mask,
                         runtime.empty_past(3), cross)
    rows = np.array([2, 2, 0])
    args = (np.full((3, 1), 7, np.int64), np.ones((3, 1), np.int64),  # [3,1]
            np.ones((3, 2), np.int64), mask[rows])
    cross_rows = runtime.take_rows(cross, rows)
    before = runtime.counters.snapshot()
    inside = runtime.step(*args, first.present, cross_rows, parents=rows)
    assert runtime.counters.since(before).runs == (2 if placement == "fallback" else 1)
    outside = runtime.step(*args, runtime.take_rows(first.present, rows), cross_rows)
    np.testing.assert_allclose(inside.logits, outside.logits, atol=1e-6, rtol=0)
    for a, b in zip(inside.present, outside.present):
        assert isinstance(a, ort.OrtValue) == (placement != "host")
        np.testing.assert_array_equal(*(v.numpy() if isinstance(v, ort.OrtValue) else v
                                        for v in (a, b)))


def test_the_fallback_decodes_what_the_host_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of an ONNX Runtime before 1.21 (or without onnx), forced: the decoder graph
    as exported, a beam step's reorder a take run of its own and a whole-row draw a run of
    the standalone draw graph; tokens and scores are the host placement's."""
    fallback = forced_fallback(monkeypatch)
    assert not fallback.reorders_in_step and fallback.draws_in_step
    assert CACHE_ROWS not in {value.name for value in fallback.decoder.get_inputs()}
    host = Runtime(artifacts("rope", "pre"))
    expected, _ = run_mixed(host)
    got, runs = run_mixed(fallback)
    for tag in expected:
        assert [h.token_ids for h in got[tag]] == [h.token_ids for h in expected[tag]], tag
        np.testing.assert_allclose([h.score for h in got[tag]],
                                   [h.score for h in expected[tag]], atol=1e-5, rtol=0)
    # each step is the device placement's runs and, where beams reorder, one take run
    _, device_runs = run_mixed(Runtime(artifacts("rope", "pre"), device_cache=True))
    extra = [ran - device for ran, device in zip(runs, device_runs)]
    assert len(runs) == len(device_runs) and set(extra) <= {0, 1} and sum(extra) >= 3, extra
    ids, mask = sources(host, [4, 6], seed=2)
    sampling = DecodingOptions(max_new_tokens=6, do_sample=True, top_p=0.8, seed=5,
                               num_return_sequences=2)
    before = fallback.counters.snapshot()
    drawn = generate(fallback, ids, mask, sampling)
    assert fallback.counters.since(before).runs > 6  # the draws: runs of their own
    want = generate(host, ids, mask, sampling)
    assert [[h.token_ids for h in r] for r in drawn] == [[h.token_ids for h in r] for r in want]


def test_the_row_gather_rewrite_refuses_a_graph_that_is_not_a_decoder(tmp_path) -> None:
    runtime = Runtime(artifacts("rope", "pre"))
    encoder = runtime.directory / runtime.manifest.encoder_file
    with pytest.raises(ValueError, match="has no input 'past_key_0'"):
        rewritten_decoder(encoder, ["past_key_0"])
