"""The static KV cache (tfserve.runtime.static_cache), forced on CPU: the dynamic path's tokens
and scores with rows joining, leaving and reordering, buffers written in place and reused,
buckets that grow, and no row graph run on the self-attention cache or the cross K/V (a
join writes its sources' cross K/V into their slots). What a captured graph needs of the
step (fixed shapes and addresses per bucket) is tests/runtime/test_static_replay.py's."""

from __future__ import annotations

import numpy as np
import pytest

from tests.exported import artifacts
from tests.waves import decode_waves, sources
from tfserve.generation import DecodingOptions, Hypothesis, make_search
from tfserve.generation.batch import DecodeBatch, Joining
from tfserve.runtime import Runtime
from tfserve.runtime.cache_graphs import DeviceCacheOps
from tfserve.runtime.static_cache import StaticCache, StaticCross, StaticPast
from tfserve.runtime.static_step import static_decoder

OPTIONS = [
    DecodingOptions(max_new_tokens=9, num_beams=4, num_return_sequences=2),
    DecodingOptions(max_new_tokens=7),
    DecodingOptions(max_new_tokens=9, do_sample=True, top_k=5, seed=3),
    DecodingOptions(max_new_tokens=8, num_beams=4, length_penalty=0.6),
    DecodingOptions(max_new_tokens=6, do_sample=True, top_p=0.9, temperature=0.8, seed=11),
    DecodingOptions(max_new_tokens=5),
    DecodingOptions(max_new_tokens=9, num_beams=2, min_new_tokens=4),
    DecodingOptions(max_new_tokens=8, num_beams=3, early_stopping=True),
]


def run_waves(
    runtime: Runtime, seed: int = 11, runs: list[int] | None = None
) -> dict[int, list[Hypothesis]]:
    """Greedy, beam and seeded sampling searches joining a running batch in four waves (the
    later ones while others are mid-decode), one cancelled, others finishing and leaving
    between the waves: each source's hypotheses. runs: the ONNX Runtime runs of each step."""
    # step 8: after rows 1 and 5 finished, into the rows they left
    waves = {0: [0, 1, 2], 2: [3, 4], 4: [5, 6], 8: [7]}
    return decode_waves(runtime, OPTIONS, [5, 3, 8, 2, 6, 4, 7, 3], waves, {5: 6}, seed,
                        runs=runs)


def assert_same(got: dict[int, list[Hypothesis]], expected: dict[int, list[Hypothesis]]) -> None:
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3, 4, 5, 7]
    for tag in expected:
        assert [h.token_ids for h in got[tag]] == [h.token_ids for h in expected[tag]], tag
        np.testing.assert_allclose(
            [h.score for h in got[tag]], [h.score for h in expected[tag]], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("positions", ["rope", "relative", "sinusoidal"])
def test_the_static_cache_gives_the_dynamic_paths_hypotheses(positions: str) -> None:
    """Rows joining into a running batch, leaving (finished, cancelled) and reordering
    (beams): greedy, beam and seeded sampling give the dynamic path's tokens and scores.
    T5's relative positions count a key's position from the mask the graph computes."""
    dynamic = Runtime(artifacts(positions, "pre"))
    static = Runtime(artifacts(positions, "pre"), kv_cache="static")
    assert isinstance(static.cache_storage, StaticCache)
    assert not static.reorders_in_step  # the StaticPast carries the rows itself
    assert_same(run_waves(static), run_waves(dynamic))


def test_no_row_graph_runs_on_either_cache(monkeypatch) -> None:
    """Neither the self-attention cache nor the cross K/V is concatenated, padded, sliced or
    gathered by a row graph: a step is the decoder's one run, whatever joins, leaves or
    changes its row count, a join writes its sources' cross K/V into their slots (one run),
    and one bucket serves the whole decode, written in place."""
    runtime = Runtime(artifacts("rope", "pre"), kv_cache="static")
    storage = runtime.cache_storage
    moved: list[tuple[str, list[int]]] = []
    row_graph = DeviceCacheOps._run

    def spy(self, kind, tensors, **small):
        moved.extend((kind, list(tensor.shape())) for tensor in tensors)
        return row_graph(self, kind, tensors, **small)

    monkeypatch.setattr(DeviceCacheOps, "_run", spy)
    decoder_runs = []
    run_decoder = runtime.decoder.run_with_iobinding
    monkeypatch.setattr(runtime.decoder, "run_with_iobinding",
                        lambda *args: decoder_runs.append(1) or run_decoder(*args))
    writes = []
    write_cross = StaticCache._write_cross
    monkeypatch.setattr(StaticCache, "_write_cross",
                        lambda self, *args: writes.append(1) or write_cross(self, *args))
    # every source of the decode (retired ones included) has a slot, every beam a row
    storage.SOURCES, storage.GROUP = 8, 4
    made, cross_made = storage.buckets_made, storage.cross_buckets_made
    steps: list[int] = []
    run_waves(runtime, runs=steps)
    assert moved == []
    assert len(decoder_runs) == len(steps)  # one run a step (besides the samplers' draws)
    assert len(writes) == 4  # run_waves' four waves, each one cross write
    assert storage.buckets_made == made + 1  # one bucket, its two sets swapped at each step
    assert storage.cross_buckets_made == cross_made + 1


def buffer_addresses(batch: DecodeBatch) -> tuple[int, ...]:
    """Where a batch's buffers lie: the self-attention cache's (both sets), the cross K/V's."""
    past, cross = batch.past, batch.cross
    assert isinstance(past, StaticPast) and past.buffers is not None
    assert isinstance(cross, StaticCross)
    return tuple(value.data_ptr() for values in (*past.buffers.sets, cross.buffers.values)
                 for value in values)


def test_rows_that_leave_free_their_slots_for_the_next_ones() -> None:
    """Rows finishing while newcomers join (mid-decode and after the others left): the
    batch keeps writing the same buffers, and the next batch takes them from the pool."""
    runtime = Runtime(artifacts("rope", "pre"), kv_cache="static")
    storage = runtime.cache_storage
    storage.SOURCES = 4  # the most sources at once: two running, two joining
    ids, mask = sources(runtime, [4, 6, 3, 5, 7, 2], seed=4)
    options = DecodingOptions(max_new_tokens=4, min_new_tokens=4).validate(100)
    made = storage.buckets_made
    addresses = set()
    for _ in range(2):  # the second batch reuses the first one's buffers
        batch = DecodeBatch(runtime)
        finished = []
        for step in range(12):
            wave = {0: [0, 1], 2: [2, 3], 6: [4, 5]}.get(step, [])
            if wave:
                _, cross = runtime.encode(ids[wave], mask[wave])
                searches = [
                    make_search(options, runtime.eos_token_id, runtime.decoder_start_token_id)
                    for _ in wave
                ]
                batch.join([Joining(searches, wave, cross, mask[wave])])
            if len(batch):
                finished += [tag for tag, _ in batch.step()]
                addresses.add(buffer_addresses(batch) if len(batch) else None)
        assert sorted(finished) == [0, 1, 2, 3, 4, 5]
    assert len(addresses - {None}) == 1  # one pair of buffer sets, at fixed addresses
    assert storage.buckets_made == made + 1


def test_a_batch_that_outgrows_its_bucket_moves_to_a_bigger_one() -> None:
    """Buckets of 2 sources x 4 columns to start with: 3 sources x 4 beams decoding 9 tokens
    grow both, once each way at most per size, with the dynamic path's results; a position
    past model.max_target_positions is refused naming it."""
    dynamic = Runtime(artifacts("rope", "pre"))
    static = Runtime(artifacts("rope", "pre"), kv_cache="static")
    storage = static.cache_storage
    storage.SOURCES, storage.LENGTH = 2, 4
    ids, mask = sources(static, [5, 3, 7], seed=6)
    options = DecodingOptions(max_new_tokens=9, min_new_tokens=9, num_beams=4).validate(100)

    def decode(runtime: Runtime) -> list[list[Hypothesis]]:
        from tfserve.generation.batch import generate

        return generate(runtime, ids, mask, [options] * 3)

    made = storage.buckets_made
    got, expected = decode(static), decode(dynamic)
    assert [[h.token_ids for h in r] for r in got] == [[h.token_ids for h in r] for r in expected]
    np.testing.assert_allclose(
        [[h.score for h in r] for r in got],
        [[h.score for h in r] for r in expected],
        atol=1e-5,
        rtol=0,
    )
    # rows 4 (3 sources in 4 slots, a row each) -> 16 (their 4 beams each), columns
    # 4 -> 8 -> 16 (10 positions)
    assert 3 <= storage.buckets_made - made <= 5
    limit = static.max_target_positions
    one = np.ones((1, 1), np.int64)
    _, cross = static.encode(ids[:1], mask[:1])
    with pytest.raises(ValueError, match="max_target_positions"):
        static.step(
            one, np.full((1, 1), limit, np.int64), one, mask[:1], static.empty_past(1), cross
        )


def test_a_step_on_taken_rows_leaves_the_batch_cache_as_it_was() -> None:
    """run_alone steps a member's rows taken from the batch (no reuse): the batch's own
    cache is not written, and it decodes on as if nothing had run; a present that a later
    step overwrote is refused."""
    runtime = Runtime(artifacts("rope", "pre"), kv_cache="static")
    dynamic = Runtime(artifacts("rope", "pre"))
    ids, mask = sources(runtime, [4, 6], seed=9)
    options = DecodingOptions(max_new_tokens=6, min_new_tokens=6, num_beams=3).validate(100)

    def decode(backend: Runtime, probe: bool) -> list[list[int]]:
        batch = DecodeBatch(backend)
        searches = [
            make_search(options, backend.eos_token_id, backend.decoder_start_token_id)
            for _ in range(2)
        ]
        batch.add(searches, [0, 1], backend.encode(ids, mask)[1], mask)
        results = {}
        for step in range(10):
            if probe and step == 3:
                assert batch.run_alone(1) is None
                assert batch.run_alone(0) is None
            results.update((tag, s.results()) for tag, s in batch.step())
            if not len(batch):
                break
        return [[h.token_ids for h in results[tag]] for tag in (0, 1)]

    assert decode(runtime, probe=True) == decode(dynamic, probe=False)
    # a present of an older step names rows that a later step overwrote
    start = np.full((1, 1), runtime.decoder_start_token_id, np.int64)  # [1,1]
    one = np.ones((1, 1), np.int64)
    cross = runtime.encode(ids[:1], mask[:1])[1]
    first = runtime.step(
        start, np.zeros((1, 1), np.int64), one, mask[:1], runtime.empty_past(1), cross
    )
    runtime.step(start, one, one, mask[:1], first.present, cross)
    with pytest.raises(ValueError, match="overwritten by a later step"):
        runtime.step(start, one, one, mask[:1], first.present, cross)


def test_the_cache_is_chosen_per_provider_and_described() -> None:
    """CPU keeps the dynamic cache (faster there); the static one is asked for by name,
    needs the device placement, and describe() (ModelInfo's runtime) says which."""
    path = artifacts("rope", "pre")
    assert Runtime(path).describe()["kv_cache"] == "dynamic"
    assert Runtime(path, device_cache=True).describe()["kv_cache"] == "dynamic"
    assert Runtime(path, kv_cache="static").describe()["kv_cache"] == "static"
    with pytest.raises(ValueError, match="kv_cache"):
        Runtime(path, kv_cache="static", device_cache=False)
    with pytest.raises(ValueError, match="kv_cache"):
        Runtime(path, kv_cache="paged")


def test_the_static_rewrite_refuses_a_graph_that_is_not_a_decoder() -> None:
    runtime = Runtime(artifacts("rope", "pre"))
    encoder = runtime.directory / runtime.manifest.encoder_file
    with pytest.raises(ValueError, match="has no input 'past_key_0'"):
        static_decoder(encoder, ["past_key_0"], ["present_key_0"], 4, 8)
