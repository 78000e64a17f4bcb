"""The static KV cache's step as a captured graph needs it (tfserve.runtime.static_cache), on
CPU: every run of a bucket at the bucket's shapes, its inputs and outputs at the same
addresses, bound once; a bucket change the only thing that binds anew; the padding rows that
make up the bucket's rows changing no row's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tests.exported import artifacts
from tests.waves import decode_waves, sources
from tfserve.generation import DecodingOptions, Hypothesis
from tfserve.runtime import Runtime
from tfserve.runtime.static_cache import StaticCache, StaticCross


@dataclass
class Bindings:
    """What the decoder's runs were bound to: each bind call (binding, name, value, its
    address and shape then), and per decoder run its binding and the bind calls before it."""

    binds: list[tuple[ort.IOBinding, str, ort.OrtValue, int, tuple[int, ...]]] = field(
        default_factory=list)
    runs: list[tuple[ort.IOBinding, int]] = field(default_factory=list)
    held: list[ort.IOBinding] = field(default_factory=list)  # kept: ids stay unique

    def bound(self, binding: ort.IOBinding, before: int) -> dict[str, tuple[int, tuple]]:
        """name -> (address, shape) as recorded when bound, for the binds before `before`."""
        return {name: (address, shape) for held, name, _, address, shape in self.binds[:before]
                if held is binding}

    def now(self, binding: ort.IOBinding, before: int) -> dict[str, tuple[int, tuple]]:
        """name -> (address, shape) of the same values at the run: where they are now."""
        return {name: (value.data_ptr(), tuple(value.shape()))
                for held, name, value, _, _ in self.binds[:before] if held is binding}


@pytest.fixture
def bindings(monkeypatch) -> Bindings:
    """Every IO binding's ortvalue binds and every decoder run, recorded."""
    record = Bindings()
    for method in ("bind_ortvalue_input", "bind_ortvalue_output"):
        original = getattr(ort.IOBinding, method)

        def spy(self, name, value, original=original):
            record.held.append(self)
            record.binds.append((self, name, value, value.data_ptr(), tuple(value.shape())))
            return original(self, name, value)

        monkeypatch.setattr(ort.IOBinding, method, spy)
    for method in ("bind_cpu_input", "bind_input", "bind_output"):  # by address or new
        original = getattr(ort.IOBinding, method)

        def other(self, name, *args, original=original, **kwargs):
            record.held.append(self)
            record.binds.append((self, name, None, -1, ()))  # type: ignore[arg-type]
            return original(self, name, *args, **kwargs)

        monkeypatch.setattr(ort.IOBinding, method, other)
    return record


def watch_decoder(runtime: Runtime, record: Bindings, monkeypatch) -> None:
    """Record the decoder's runs (its binding, and how many binds came before)."""
    run = runtime.decoder.run_with_iobinding

    def spy(binding, *args):
        record.runs.append((binding, len(record.binds)))
        return run(binding, *args)

    monkeypatch.setattr(runtime.decoder, "run_with_iobinding", spy)


def decode(runtime: Runtime, options: list[DecodingOptions], lengths: list[int],
           waves: dict[int, list[int]], cancel: dict[int, int], rows: list[int] | None = None
           ) -> dict[int, list[Hypothesis]]:
    """Sources of `lengths` joining a running batch at the steps of `waves`, each wave
    encoded at its own longest source's width (decode_waves). rows: the batch's rows at
    each step."""
    return decode_waves(runtime, options, lengths, waves, cancel, seed=5, own_width=True,
                        rows=rows)


def assert_same(got: dict[int, list[Hypothesis]], expected: dict[int, list[Hypothesis]]
                ) -> None:
    assert sorted(got) == sorted(expected)
    for tag in expected:
        assert [h.token_ids for h in got[tag]] == [h.token_ids for h in expected[tag]], tag
        np.testing.assert_allclose([h.score for h in got[tag]],
                                   [h.score for h in expected[tag]], atol=1e-5, rtol=0)


GREEDY_AND_SAMPLING = [
    DecodingOptions(max_new_tokens=9),
    DecodingOptions(max_new_tokens=7, do_sample=True, top_k=5, seed=3),
    DecodingOptions(max_new_tokens=4, min_new_tokens=4),
    DecodingOptions(max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.8, seed=11),
    DecodingOptions(max_new_tokens=6, min_new_tokens=6),
    DecodingOptions(max_new_tokens=9, do_sample=True, seed=7),
    DecodingOptions(max_new_tokens=5),
]


def test_a_buckets_runs_have_fixed_shapes_and_addresses(bindings: Bindings,
                                                        monkeypatch) -> None:
    """Greedy and sampling rows joining in waves, finishing and one cancelled, all inside one
    bucket: every decoder run is one of the bucket's two bindings (one per buffer set it
    reads), bound before the first run and never again, its values at the addresses and
    shapes they were bound at; the dynamic path's tokens and scores."""
    waves, cancel = {0: [0, 1, 2], 2: [3, 4], 5: [5, 6]}, {4: 4}
    lengths = [5, 3, 8, 2, 6, 4, 7]
    expected = decode(Runtime(artifacts("rope", "pre")), GREEDY_AND_SAMPLING, lengths, waves,
                      cancel)
    runtime = Runtime(artifacts("rope", "pre"), kv_cache="static")
    storage = runtime.cache_storage
    assert isinstance(storage, StaticCache)
    storage.SOURCES = 8  # every source has a slot: one bucket for the whole decode
    watch_decoder(runtime, bindings, monkeypatch)
    rows: list[int] = []
    assert_same(decode(runtime, GREEDY_AND_SAMPLING, lengths, waves, cancel, rows), expected)
    assert len(set(rows)) > 2  # rows joined and left
    used = {id(binding): binding for binding, _ in bindings.runs}
    assert len(used) == 2
    first_run = bindings.runs[0][1]
    assert all(held not in used.values() for held, *_ in bindings.binds[first_run:])
    for binding, before in bindings.runs:
        bound = bindings.bound(binding, before)
        assert -1 not in {address for address, _ in bound.values()}  # no bind by copy
        assert bindings.now(binding, before) == bound
    maps = [bindings.bound(binding, first_run) for binding in used.values()]
    shapes = [{name: shape for name, (_, shape) in bound.items()} for bound in maps]
    assert shapes[0] == shapes[1]
    assert shapes[0]["input_ids"] == (8, 1) and shapes[0]["cross_key_0"][0] == 8  # [R,1]
    # the two differ in which buffer set they read and write, nothing else
    differ = {name for name in maps[0] if maps[0][name] != maps[1][name]}
    assert differ and all(name.startswith(("past_", "present_")) for name in differ)
    assert maps[0]["past_key_0"] == maps[1]["present_key_0"]


def test_a_bucket_change_is_what_binds_anew(bindings: Bindings, monkeypatch) -> None:
    """Buckets as small as they go, outgrown by a decode of beams and greedy rows whose
    later sources are longer: the sources, rows per source, columns and source columns
    grow, each growth a new bucket; a binding, once run, is never bound again, and a
    bucket's runs after its first alternate between its two bindings. The dynamic path's
    tokens and scores."""
    options = [
        DecodingOptions(max_new_tokens=9, num_beams=4, num_return_sequences=2),
        DecodingOptions(max_new_tokens=7),
        DecodingOptions(max_new_tokens=8, num_beams=3, length_penalty=0.6),
        DecodingOptions(max_new_tokens=6, do_sample=True, top_k=5, seed=3),
        DecodingOptions(max_new_tokens=9, num_beams=2, min_new_tokens=4),
    ]
    waves, cancel = {0: [0, 1], 3: [2, 3], 6: [4]}, {5: 3}
    lengths = [2, 3, 6, 2, 12]  # the source columns: 4, then 8, then 16
    expected = decode(Runtime(artifacts("relative", "pre")), options, lengths, waves, cancel)
    runtime = Runtime(artifacts("relative", "pre"), kv_cache="static")
    storage = runtime.cache_storage
    assert isinstance(storage, StaticCache)
    storage.SOURCES, storage.LENGTH, storage.SOURCE_LENGTH = 1, 4, 4
    watch_decoder(runtime, bindings, monkeypatch)
    assert_same(decode(runtime, options, lengths, waves, cancel), expected)

    def bucket(binding: ort.IOBinding, before: int) -> tuple:
        """The shapes a run is bound at, less the buffers it reads (a bucket's first run
        reads the last bucket's)."""
        return tuple(sorted((name, shape) for name, (_, shape)
                            in bindings.bound(binding, before).items()
                            if not name.startswith("past_")))

    stretches: list[list[ort.IOBinding]] = []
    keys: list[tuple] = []
    for binding, before in bindings.runs:
        assert bindings.now(binding, before) == bindings.bound(binding, before)
        key = bucket(binding, before)
        if not keys or key != keys[-1]:
            assert key not in keys  # a bucket is left for a bigger one only
            keys.append(key)
            stretches.append([])
        stretches[-1].append(binding)
    for runs in stretches:
        steady = runs[1:]
        assert len({id(binding) for binding in steady}) <= 2
        assert all(a is b for a, b in zip(steady, steady[2:]))  # alternating
    for number, (binding, before) in enumerate(bindings.runs):  # no bind once run
        later = [held for held, *_ in bindings.binds[before:]]
        assert binding not in later, number
    dims = [dict(key) for key in keys]
    grew = {
        "rows": len({d["input_ids"][0] for d in dims}),
        "sources": len({d["encoder_attention_mask"][0] for d in dims}),
        "columns": len({d["present_key_0"][2] for d in dims}),
        "source columns": len({d["encoder_attention_mask"][1] for d in dims}),
    }
    assert min(grew.values()) >= 2, grew
    assert storage.cross_buckets_made >= 3  # sources 2 -> 4, source columns 4 -> 8 -> 16


def test_padding_rows_change_no_rows_result() -> None:
    """Three rows run as rows of a bucket of 8 (then 16: two rows of one source): each row's
    logits are the dynamic path's, a first step and a step on reordered rows that share a
    source's cross K/V."""
    dynamic = Runtime(artifacts("sinusoidal", "pre"))
    static = Runtime(artifacts("sinusoidal", "pre"), kv_cache="static")
    storage = static.cache_storage
    assert isinstance(storage, StaticCache)
    storage.SOURCES = 8
    ids, mask = sources(static, [4, 7, 2], seed=3)
    start = np.full((3, 1), static.decoder_start_token_id, np.int64)  # [3,1]
    zero = np.zeros((3, 1), np.int64)  # [3,1]

    def two_steps(runtime: Runtime, cross: Any) -> list[np.ndarray]:
        first = runtime.step(start, zero, np.ones((3, 1), np.int64), mask, runtime.empty_past(3),
                             cross)
        order = np.array([2, 0, 0])  # rows 1 and 2 continue row 0, of source 0
        tokens = np.array([[5], [9], [17]], np.int64)  # [3,1]
        second = runtime.step(tokens, zero + 1, np.ones((3, 2), np.int64), mask[order],
                              runtime.take_rows(first.present, order, reuse=True),
                              runtime.take_rows(cross, order))
        return [first.logits, second.logits]

    expected = two_steps(dynamic, dynamic.encode(ids, mask)[1])
    _, cross = static.encode(ids, mask)
    cross = static.pad_time(cross, mask.shape[1], left=False)
    assert isinstance(cross, StaticCross)
    got = two_steps(static, cross)
    for logits, want in zip(got, expected):
        assert logits.shape == want.shape == (3, 1, static.vocab_size)
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
