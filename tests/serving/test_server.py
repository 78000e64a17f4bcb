"""End-to-end tests of the gRPC server: a real server on a loopback ephemeral port, real clients.

Most tests use a small random model (exported once per session): batching invariance, errors,
cancellation and drain do not need good translations. The "translations are correct" tests
use the bundled demo (exported through tfserve.demo.default_artifacts into a session cache)
and are skipped until its trained checkpoint exists.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_helpers import (
    Gate,
    ObservedBackend,
    ProcessGate,
    ServerProcess,
    ServerThread,
    free_port,
    server_args,
    wait_queued,
)
from test_scheduler import FakeClock

from tfserve.client import AsyncClient, Client, ServerError
from tfserve.proto import translator_pb2 as pb2
from tfserve.proto import translator_pb2_grpc as pb2_grpc

TEXTS = ["seven", "twenty-one", "three hundred and forty-two", "eight thousand and five",
         "ninety-nine", "one hundred", "four hundred and twelve thousand six hundred",
         "sixty"]


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def random_runtime(random_model: Path) -> Any:
    from tfserve.runtime import Runtime

    return Runtime(random_model, intra_op_threads=1)


@pytest.fixture(scope="module")
def server(random_model: Path, random_runtime: Any) -> Any:
    """A shared server: max batch 8 rows, so 32 clients queue and join between steps."""
    with ServerThread(server_args(random_model, "--max-batch-size", "8",
                                  "--metrics-port", str(free_port())),
                      runtime=random_runtime) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> Any:
    with Client(server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def demo_server(demo_model: Path) -> Any:
    with ServerThread(server_args(demo_model)) as running:
        yield running


def same(a: list[Any], b: list[Any], atol: float = 1e-4) -> bool:
    """Hypothesis lists with identical tokens and scores within atol."""
    return (len(a) == len(b) and all(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
            and all(abs(x.score - y.score) <= atol for x, y in zip(a, b, strict=True)))


# -- translations ---------------------------------------------------------------------------


def test_demo_translations_are_correct(demo_server: ServerThread) -> None:
    expected = {"three hundred and forty-two": "trois cent quarante-deux", "seven": "sept",
                "twenty-one": "vingt et un"}
    with Client(demo_server.target, timeout=60) as client:
        assert client.translate(list(expected)) == list(expected.values())
        assert client.translate(list(expected), num_beams=4) == list(expected.values())
        for text, french in expected.items():
            chunks = list(client.translate_stream([text]))
            assert "".join(c.text_delta for c in chunks) == french
            assert chunks[-1].done and chunks[-1].final.text == french
            assert sum(not c.done for c in chunks) >= 1  # tokens came as they were decided


@pytest.mark.parametrize("options", [
    dict(max_new_tokens=9, min_new_tokens=4),
    dict(max_new_tokens=7, min_new_tokens=2, do_sample=True, seed=3, top_k=20),
    dict(max_new_tokens=6, num_beams=3, num_return_sequences=2),
], ids=["greedy", "sampling", "beam"])
def test_stream_chunks_concatenate_to_unary(client: Client, options: dict[str, Any]) -> None:
    texts = TEXTS[:3]
    unary = client.translate_hypotheses(texts, **options)
    chunks = list(client.translate_stream(texts, **options))
    for index, hypotheses in enumerate(unary):
        mine = [c for c in chunks if c.index == index]
        assert mine[-1].done and sum(c.done for c in mine) == 1
        assert "".join(c.text_delta for c in mine) == hypotheses[0].text
        assert [t for c in mine for t in c.token_ids] == hypotheses[0].token_ids
        assert same([mine[-1].final], hypotheses[:1])
        if not options.get("num_beams"):
            assert len(mine) > 2  # single hypothesis: streamed token by token
        else:
            assert len(mine) == 1 and same(mine[-1].hypotheses, hypotheses)


def test_text_deltas_with_sentencepiece_whitespace(random_runtime: Any) -> None:
    from tfserve.serving.stream import TextDelta

    tokenizer = random_runtime.tokenizer
    target = "quatre cent douze mille six cents"
    ids = tokenizer.encode(target)[:-1]
    delta = TextDelta(tokenizer.decode)
    pieces = [delta.push([token]) for token in ids]
    assert "".join(pieces) == tokenizer.decode(ids)


def test_encode_matches_offline_translator(client: Client, random_model: Path) -> None:
    from tfserve.translator import Translator

    offline = Translator(random_model, intra_op_threads=1)
    for pooling in ("mean", "max", "first"):
        expected = offline.encode(TEXTS, pooling=pooling)
        got = client.encode(TEXTS, pooling=pooling, per_token=True)
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_allclose(g.embedding, e.embedding, atol=1e-5, rtol=0)
            np.testing.assert_allclose(g.hidden_states, e.hidden_states, atol=1e-5, rtol=0)
            assert g.token_ids == e.token_ids
    assert client.encode(["seven"])[0].hidden_states.shape == (0, 32)  # not requested


def test_token_id_input_and_request_id(client: Client, server: ServerThread,
                                       random_runtime: Any) -> None:
    ids = random_runtime.tokenizer.encode("twenty-one")
    by_text = client.translate_hypotheses(["twenty-one"], max_new_tokens=5)
    assert same(client.translate_hypotheses(token_ids=[ids], max_new_tokens=5)[0], by_text[0])
    assert same(client.translate_hypotheses(token_ids=[ids[:-1]], max_new_tokens=5)[0],
                by_text[0])  # eos appended
    stub = pb2_grpc.TranslatorStub(client.channel)
    response, call = stub.Translate.with_call(
        pb2.TranslateRequest(texts=["seven"], request_id="req-42",
                             options=pb2.DecodingOptions(max_new_tokens=2)))
    assert response.request_id == "req-42"
    # unary calls echo the id in the trailers (no header write of their own)
    assert ("x-request-id", "req-42") in call.trailing_metadata()
    response, call = stub.Translate.with_call(pb2.TranslateRequest(texts=["seven"]))
    assert len(response.request_id) == 32
    assert ("x-request-id", response.request_id) in call.trailing_metadata()
    with pytest.raises(grpc.RpcError) as failed:
        stub.Translate(pb2.TranslateRequest(texts=[], request_id="req-bad"))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("x-request-id", "req-bad") in failed.value.trailing_metadata()
    # a stream sends it in its headers, before the first chunk
    stream = stub.TranslateStream(pb2.TranslateRequest(texts=["seven"], request_id="req-7"))
    assert ("x-request-id", "req-7") in stream.initial_metadata()
    assert list(stream)


def test_model_info(client: Client) -> None:
    info = client.model_info()
    assert info.model_name == "random-test-model" and info.vocab_size == 111
    assert info.d_model == 32 and info.num_heads == 4 and info.positions == "rope"
    assert info.max_source_tokens == 128 and info.dtype == "fp32" and info.device == "cpu"
    assert info.limits.max_batch_size == 8 and info.limits.default_max_new_tokens == 127
    assert info.parity.passed and info.parity.max_abs_logits_diff < 1e-4
    assert info.tfserve_version


def test_async_client(server: ServerThread, client: Client) -> None:
    async def run() -> tuple[Any, ...]:
        async with AsyncClient(server.target, timeout=60) as aclient:
            results = await asyncio.gather(
                *(aclient.translate_hypotheses([text], max_new_tokens=6) for text in TEXTS))
            chunks = [c async for c in aclient.translate_stream(["seven"], max_new_tokens=6)]
            return results, chunks, await aclient.health(), await aclient.encode(["seven"])

    results, chunks, health, encodings = asyncio.run(run())
    alone = client.translate_hypotheses(TEXTS, max_new_tokens=6)
    assert all(same(r[0], a) for r, a in zip(results, alone, strict=True))
    assert "".join(c.text_delta for c in chunks) == alone[0][0].text
    assert health == "SERVING" and encodings[0].embedding.shape == (32,)


# -- batching invariance --------------------------------------------------------------------

OPTION_POOL = [
    dict(max_new_tokens=3),
    dict(max_new_tokens=8),
    dict(max_new_tokens=12, min_new_tokens=12),
    dict(max_new_tokens=6, num_beams=2),
    dict(max_new_tokens=5, num_beams=3, num_return_sequences=2),
    dict(max_new_tokens=7, num_beams=4, length_penalty=0.5),
    dict(max_new_tokens=6, do_sample=True, seed=1),
    dict(max_new_tokens=9, do_sample=True, seed=7, top_k=10, temperature=0.8),
    dict(max_new_tokens=5, do_sample=True, seed=11, top_p=0.9, num_return_sequences=3),
]


def run_invariance(server: ServerThread, requests: int, clients: int, seed: int) -> None:
    rng = random.Random(seed)
    plan = [([rng.choice(TEXTS) for _ in range(rng.choice((1, 1, 2, 3)))],
             rng.randrange(len(OPTION_POOL))) for _ in range(requests)]
    with Client(server.target, timeout=120) as client:
        # every (text, options) pair alone: one text, nothing else on the server
        alone = {(text, option): client.translate_hypotheses([text], **OPTION_POOL[option])[0]
                 for option in sorted({o for _, o in plan})
                 for text in sorted({t for texts, o in plan if o == option for t in texts})}
        # the worker is held before its first decoder step until 8 inputs wait behind it:
        # they join the running batch between two steps whatever the machine's speed
        with Gate(server.scheduler) as gate, ThreadPoolExecutor(clients) as pool:
            pending = pool.map(
                lambda p: client.translate_hypotheses(p[0], **OPTION_POOL[p[1]]), plan)
            gate.wait_held()
            wait_queued(server.scheduler, 8)
            gate.open()
            answers = list(pending)
    mismatches = [(texts, OPTION_POOL[option], index)
                  for (texts, option), answer in zip(plan, answers, strict=True)
                  for index, text in enumerate(texts)
                  if not same(answer[index], alone[text, option])]
    assert not mismatches, f"{len(mismatches)} answers differ from the lone request, e.g. " \
                           f"{mismatches[:3]}"
    assert max(rows for stage, rows in gate.calls if stage == "step") > 3, \
        "the load never shared a decoder batch"


def test_batching_invariance_under_load(server: ServerThread) -> None:
    run_invariance(server, requests=300, clients=32, seed=0)


@pytest.mark.slow
def test_batching_invariance_under_heavy_load(server: ServerThread) -> None:
    run_invariance(server, requests=2000, clients=64, seed=1)


# -- the scheduler pass by pass (run_once, no worker thread) -----------------------------------


def stepped_scheduler(runtime: Any, clock: FakeClock | None = None, **config: Any) -> Any:
    """A Scheduler over the random model that no thread runs: the test drives it pass by pass
    with run_once(), on a clock that moves only when the test moves it. Waits for company
    are off unless `config` turns them on."""
    from tfserve.scheduler import Scheduler, SchedulerConfig

    settings: dict[str, Any] = dict(max_wait_ms=0.0, wave_wait_steps=0)
    settings.update(config)
    return Scheduler(runtime, SchedulerConfig(**settings), clock=clock or FakeClock())


def run_until(scheduler: Any, done: Callable[[], bool], limit: int = 1000) -> int:
    """run_once until done(); the passes it took."""
    for passes in range(limit):
        if done():
            return passes
        scheduler.run_once()
    raise AssertionError(f"not done after {limit} passes")


def test_scheduler_reuses_a_batch_emptied_by_cancellation(random_runtime: Any) -> None:
    """Every running request is cancelled mid-decoding: the batch they leave empty takes new
    requests, whose answers are what they were before."""
    from tfserve.generation import DecodingOptions
    from tfserve.scheduler import Cancelled

    source = random_runtime.tokenizer.encode("twenty-one")
    short = DecodingOptions(max_new_tokens=5)
    scheduler = stepped_scheduler(random_runtime, max_batch_size=4)
    first = scheduler.submit_translate([source, source], short)
    run_until(scheduler, lambda: first.done)
    expected = first.result(0)
    long = [scheduler.submit_translate([source], DecodingOptions(
        max_new_tokens=60, min_new_tokens=60)) for _ in range(2)]
    for _ in range(3):
        scheduler.run_once()
    assert len(scheduler._batch) == 2
    for job in long:
        job.cancel()
    scheduler.run_once()
    assert scheduler.idle  # both left before the next step: the batch is empty
    again = scheduler.submit_translate([source, source], short)
    run_until(scheduler, lambda: again.done)
    assert all(same(a, b) for a, b in zip(again.result(0), expected, strict=True))
    for job in long:
        with pytest.raises(Cancelled):
            job.result(0)
    assert scheduler.stats.model_errors == 0
    assert scheduler.stats.freed_rows["cancelled"] == 2


def test_continuous_batching_respects_row_limit(random_runtime: Any) -> None:
    """Scheduler alone (no gRPC): late requests join a running batch; rows never exceed max."""
    from tfserve.generation import DecodingOptions

    seen_rows: list[int] = []
    scheduler = stepped_scheduler(ObservedBackend(
        random_runtime, lambda stage: seen_rows.append(scheduler._batch.rows) if (
            stage == "step") else None), max_batch_size=6)
    source = random_runtime.tokenizer.encode("seven")
    first = scheduler.submit_translate([source], DecodingOptions(max_new_tokens=30,
                                                                 min_new_tokens=30))
    for _ in range(3):
        scheduler.run_once()
    late = [scheduler.submit_translate([source], DecodingOptions(
        max_new_tokens=4, num_beams=beams)) for beams in (2, 3, 4, 1)]
    run_until(scheduler, lambda: all(job.done for job in [first, *late]))
    results = [job.result(0) for job in late]
    assert max(seen_rows) <= 6
    assert len(first.result(0)[0][0].token_ids) == 30 and all(len(r[0]) == 1 for r in results)
    # the late requests decoded while the first was still running: the first two joined at
    # the next step, the others when rows were free
    assert seen_rows[:3] == [1, 1, 1] and seen_rows[3] > 1
    assert max(seen_rows) > 1 and seen_rows.index(max(seen_rows)) < 30


@pytest.mark.parametrize("case", ["returning", "fresh", "wave-wait-off"])
def test_returning_rows_join_together_while_decoding(random_runtime: Any, case: str) -> None:
    """Closed-loop clients whose requests finished on one step come back a little apart:
    while the batch still decodes, the first arrivals wait for the others (up to
    wave_wait_steps steps) and all join in one encoder run. Requests that nothing finished
    before join at the next step, and so do all of them with wave_wait_steps=0.

    The clock stands still, so the wait for the returning wave lasts until it is complete;
    the arrivals come a decoder step apart."""
    from tfserve.generation import DecodingOptions

    source = random_runtime.tokenizer.encode("seven")
    short = DecodingOptions(max_new_tokens=3, min_new_tokens=3)
    events: list[str] = []  # model calls and arrivals, in order
    scheduler = stepped_scheduler(ObservedBackend(random_runtime, events.append),
                                  max_batch_size=8,
                                  wave_wait_steps=0 if case == "wave-wait-off" else 4)
    running = scheduler.submit_translate([source], DecodingOptions(max_new_tokens=60,
                                                                   min_new_tokens=60))
    scheduler.run_once()
    scheduler.run_once()
    if case != "fresh":
        first = [scheduler.submit_translate([source], short) for _ in range(3)]
        run_until(scheduler, lambda: all(job.done for job in first))  # on the same step
    events.clear()
    again = []
    for _ in range(3):  # they return a step apart, while the long request decodes
        events.append("arrival")
        again.append(scheduler.submit_translate([source], short))
        scheduler.run_once()
    run_until(scheduler, lambda: all(job.done for job in again))
    results = [job.result(0) for job in again]
    assert not running.done
    assert all(len(r[0]) == 1 for r in results)
    if case == "returning":  # one encoder run once the third is back; steps meanwhile
        assert events[:6] == ["arrival", "step", "arrival", "step", "arrival", "encode"]
    else:  # each joins at the next step
        assert events[:7] == ["arrival", "encode", "step", "arrival", "encode", "step",
                              "arrival"]
        assert events[7] == "encode"
    assert scheduler.stats.model_errors == 0


class Wave(NamedTuple):
    scheduler: Any
    source: list[int]
    short: Any  # DecodingOptions: 3 new tokens
    expected: list[Any]  # the source translated alone with `short`
    events: list[str]  # "arrival" (the test's), "encode", "step": in order, from the set-up on
    first_step_rows: list[int]  # the rows of the first decoder step after the set-up


def returning_wave(runtime: Any, encode_ahead: bool,
                   on_encode: Callable[[], None] | None = None) -> Wave:
    """A scheduler (8 rows, max_wait_ms 0) driven pass by pass on a clock that stands still,
    so that a wait for company lasts until the company is there. Three requests have just
    finished on the same step and left the batch empty (their 8 steps taught the scheduler
    the step time): the next arrivals are their clients coming back, and the worker waits for
    all three (`arrive` sends one back). `on_encode` runs before every encoder run of a
    translate request."""
    from tfserve.generation import DecodingOptions

    source = runtime.tokenizer.encode("seven")
    short = DecodingOptions(max_new_tokens=3, min_new_tokens=3)
    events: list[str] = []
    first_step_rows: list[int] = []

    def hook(stage: str) -> None:
        events.append(stage)
        if stage == "step" and not first_step_rows:
            first_step_rows.append(scheduler._batch.rows)
        elif stage == "encode" and on_encode is not None:
            on_encode()

    runs = ObservedBackend(runtime)  # observed from the end of the set-up on
    scheduler = stepped_scheduler(runs, max_batch_size=8, wave_wait_steps=4,
                                  encode_ahead=encode_ahead)
    alone = scheduler.submit_translate([source], short)
    run_until(scheduler, lambda: alone.done)
    runs.before = hook
    first = DecodingOptions(max_new_tokens=8, min_new_tokens=8)
    jobs = [scheduler.submit_translate([source], first) for _ in range(3)]
    run_until(scheduler, lambda: all(job.done for job in jobs))
    assert scheduler.idle
    events.clear()
    first_step_rows.clear()
    return Wave(scheduler, source, short, alone.result(0), events, first_step_rows)


def reserved_rows(scheduler: Any) -> int:
    """The rows the scheduler's running batch and the live items encoded ahead may occupy."""
    return int(scheduler.policy.reserved_rows(scheduler._running()))


def arrive(wave: Wave) -> Any:
    """A returning client's request (the job)."""
    wave.events.append("arrival")
    return wave.scheduler.submit_translate([wave.source], wave.short)


@pytest.mark.parametrize("encode_ahead", [True, False])
def test_idle_worker_encodes_returning_rows_ahead(random_runtime: Any,
                                                  encode_ahead: bool) -> None:
    """With nothing to decode, the worker encodes returning requests as they arrive while it
    waits for the rest of the wave, and all of them join the decoder batch together; an
    encoder failure meanwhile fails only its own request. Without encode_ahead they are
    encoded together once the wait ends."""
    from tfserve.scheduler import ModelError

    encoder_runs: list[int] = []

    def on_encode() -> None:
        encoder_runs.append(len(encoder_runs))
        if encode_ahead and len(encoder_runs) == 2:
            raise RuntimeError("simulated encoder failure")

    wave = returning_wave(random_runtime, encode_ahead, on_encode)
    encoder_runs.clear()  # those of the set-up
    scheduler = wave.scheduler
    again = []
    for arrival in range(3):
        again.append(arrive(wave))
        if arrival < 2:  # the worker thread would encode it now / go on waiting
            assert scheduler._may_encode_ahead() is encode_ahead
            assert scheduler._batching_wait() > 0
        scheduler.run_once()
    run_until(scheduler, lambda: all(job.done for job in again))
    outcomes = []
    for job in again:
        try:
            outcomes.append(job.result(0))
        except ModelError:
            outcomes.append(None)
    if encode_ahead:
        # each encoded as it came, before the next arrived, not all once the wait ended
        assert wave.events[:7] == ["arrival", "encode", "arrival", "encode", "arrival",
                                   "encode", "step"]
        assert outcomes[1] is None and scheduler.stats.model_errors == 1
        assert wave.first_step_rows == [2]  # the two encoded ones joined together
        assert all(same(outcomes[i][0], wave.expected[0]) for i in (0, 2))
    else:
        assert wave.events[:5] == ["arrival", "arrival", "arrival", "encode", "step"]
        assert wave.first_step_rows == [3]
        assert all(same(outcome[0], wave.expected[0]) for outcome in outcomes)


def test_a_request_cancelled_while_encoded_ahead_frees_its_rows(random_runtime: Any) -> None:
    """A returning request encoded ahead and then cancelled stops reserving its rows at once,
    never joins the decoder batch, and counts as dropped before decoding (0 rows freed, all
    its steps saved); the rest of its wave joins without it."""
    wave = returning_wave(random_runtime, encode_ahead=True)
    scheduler = wave.scheduler
    gone = arrive(wave)
    scheduler.run_once()
    assert len(scheduler._ahead) == 1  # encoded and held, waiting for the other two
    assert not len(scheduler._batch) and reserved_rows(scheduler) == 1
    gone.cancel()
    assert reserved_rows(scheduler) == 0
    again = [arrive(wave) for _ in range(2)]
    run_until(scheduler, lambda: all(job.done for job in again))
    assert wave.first_step_rows == [2]
    assert all(same(job.result(0)[0], wave.expected[0]) for job in again)
    assert scheduler.stats.freed_rows.get("cancelled", 0) == 0
    assert scheduler.stats.skipped_steps["cancelled"] == 3


def test_an_encode_request_does_not_end_the_wait_for_company(random_runtime: Any) -> None:
    """An Encode request that arrives while returning translate rows are encoded ahead and
    held is served at once, and the held rows keep waiting for the rest of their wave."""
    wave = returning_wave(random_runtime, encode_ahead=True)
    scheduler = wave.scheduler
    again = [arrive(wave)]
    scheduler.run_once()
    encode = scheduler.submit_encode([wave.source])
    assert scheduler._batching_wait() == 0  # the worker thread would start now
    scheduler.run_once()
    assert encode.done and encode.queue_seconds == 0.0  # in the pass after it came
    assert len(scheduler._ahead) == 1 and not len(scheduler._batch)  # still held
    for _ in range(2):
        again.append(arrive(wave))
        scheduler.run_once()
    run_until(scheduler, lambda: all(job.done for job in again))
    assert wave.first_step_rows == [3]
    assert encode.result(0)[0].embedding.shape == (32,)


def test_encode_requests_never_wait_for_returning_rows(random_runtime: Any) -> None:
    """Right after translate requests finished, an Encode request starts at once: the wait
    for returning clients is for translation rows only."""
    from tfserve.generation import DecodingOptions
    from tfserve.scheduler import SchedulerConfig

    source = random_runtime.tokenizer.encode("seven")
    clock = FakeClock()
    defaults = SchedulerConfig()  # the server's waits: max_wait_ms 2, wave_wait_steps 4
    scheduler = stepped_scheduler(random_runtime, clock, max_wait_ms=defaults.max_wait_ms,
                                  wave_wait_steps=defaults.wave_wait_steps)
    short = DecodingOptions(max_new_tokens=3, min_new_tokens=3)
    jobs = [scheduler.submit_translate([source], short) for _ in range(4)]
    run_until(scheduler, lambda: all(job.done for job in jobs))
    returning = scheduler.submit_translate([source], short)  # waits for the other three
    encode = scheduler.submit_encode([source])
    assert scheduler._batching_wait() == 0  # the worker thread would start now
    scheduler.run_once()
    assert encode.done and encode.queue_seconds == 0.0
    assert not returning.done and len(scheduler.policy.translate_queue) == 1
    clock.now += 3600.0  # the wait for the rest of the wave is over
    run_until(scheduler, lambda: returning.done)
    assert returning.queue_seconds == 3600.0


# -- cancellation, deadlines, queue, failures -----------------------------------------------


def past_every_deadline() -> float:
    """A scheduler clock an hour ahead of time.monotonic (which the server sets deadlines
    from): every request with a deadline has run out of time on it."""
    return time.monotonic() + 3600.0


def test_cancelled_and_expired_requests_stop_decoding(random_model: Path,
                                                      random_runtime: Any) -> None:
    """A request cancelled by its client and one whose deadline passes, both while decoding,
    leave the batch before the next step: their rows are freed and their remaining steps
    skipped, and the requests after them are answered as before. The worker is held before a
    step while both decode (the second joins at the next step: no waits for company); the
    deadline passes on the scheduler's clock, set past it."""
    with ServerThread(server_args(random_model, "--max-batch-size", "4", "--max-wait-ms", "0",
                                  "--wave-wait-steps", "0"),
                      runtime=random_runtime) as server, Client(server.target) as client:
        long = dict(max_new_tokens=100, min_new_tokens=100)
        short = dict(max_new_tokens=6)
        expected = client.translate_hypotheses(TEXTS[:2], **short)
        scheduler = server.scheduler
        stats = scheduler.stats
        steps_before = stats.steps
        stub = pb2_grpc.TranslatorStub(client.channel)
        with Gate(scheduler) as gate, ThreadPoolExecutor(1) as pool:
            cancelled = stub.Translate.future(pb2.TranslateRequest(
                texts=["seven"], options=pb2.DecodingOptions(**long)))
            assert gate.wait_held() == 1
            expiring = pool.submit(client.translate, ["twenty-one"], timeout=60, **long)
            wait_queued(scheduler, 1)
            gate.step()
            assert gate.wait_held() == 2  # both decoding
            cancelled.cancel()
            server.wait_until(lambda: server.in_flight == 1)  # the server let it go
            scheduler.clock = past_every_deadline
            gate.open()
            with pytest.raises(ServerError) as expired:
                expiring.result(60)
            scheduler.clock = time.monotonic
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.FutureCancelledError):
            cancelled.result()
        # the requests after them are not disturbed
        again = client.translate_hypotheses(TEXTS[:2], **short)
        assert all(same(a, b) for a, b in zip(again, expected, strict=True))
        assert scheduler.idle  # the long ones left
        steps = stats.steps - steps_before
        assert steps < 100, f"{steps} steps: the dropped requests kept decoding"
        assert stats.freed_rows.get("deadline", 0) == 1
        assert stats.freed_rows.get("cancelled", 0) == 1
        assert stats.skipped_steps.get("deadline", 0) + stats.skipped_steps.get(
            "cancelled", 0) > 100
        assert server.metrics.value("tfserve_freed_rows_total", {"reason": "deadline"}) == 1
        assert server.metrics.value("tfserve_skipped_steps_total", {"reason": "cancelled"}) > 0


def test_deadline_while_queued(random_model: Path, random_runtime: Any) -> None:
    """A request whose deadline passes while it waits for a row ends DEADLINE_EXCEEDED
    without decoding; the request holding the row is answered. The worker is held before a
    step of that request, so the other one stays queued; its deadline passes on the
    scheduler's clock."""
    with ServerThread(server_args(random_model, "--max-batch-size", "1"),
                      runtime=random_runtime) as server, Client(server.target) as client:
        scheduler = server.scheduler
        with Gate(scheduler) as gate, ThreadPoolExecutor(2) as pool:
            busy = pool.submit(client.translate, ["seven"], max_new_tokens=40,
                               min_new_tokens=40)
            assert gate.wait_held() == 1  # busy holds the one row
            queued = pool.submit(client.translate, ["eight"], timeout=60, max_new_tokens=3)
            wait_queued(scheduler, 1)
            scheduler.clock = past_every_deadline
            gate.open()
            with pytest.raises(ServerError) as expired:
                queued.result(60)
            scheduler.clock = time.monotonic
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert len(busy.result(60)) == 1
        assert scheduler.stats.freed_rows.get("deadline", 0) == 0  # never decoded
        assert scheduler.stats.skipped_steps["deadline"] == 3  # every step saved


def test_queue_full_is_resource_exhausted(random_model: Path, random_runtime: Any) -> None:
    """With the row taken and --max-queue requests waiting, further requests are refused at
    once with RESOURCE_EXHAUSTED; the queued ones are answered as they would be alone. The
    worker is held before a step of the first request, so nothing leaves the queue."""
    with ServerThread(server_args(random_model, "--max-batch-size", "1", "--max-queue", "2"),
                      runtime=random_runtime) as server, Client(server.target) as client:
        expected = client.translate_hypotheses(["seven"], max_new_tokens=5)

        def send(_: int) -> Any:
            try:
                return client.translate_hypotheses(["seven"], max_new_tokens=5)
            except ServerError as exc:
                return exc.code()

        with Gate(server.scheduler) as gate, ThreadPoolExecutor(12) as pool:
            first = pool.submit(send, 0)
            gate.wait_held()  # decoding: it holds the one row
            rest = [pool.submit(send, i) for i in range(1, 12)]
            # two wait in the queue and cannot end while the worker is held: the first nine
            # to end are the refused ones
            refused = [future.result() for future in
                       itertools.islice(as_completed(rest, timeout=60), 9)]
            assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 9
            assert sum(not future.done() for future in rest) == 2
            gate.open()
            outcomes = [first.result(60)] + [future.result(60) for future in rest]
        answers = [o for o in outcomes if not isinstance(o, grpc.StatusCode)]
        assert len(answers) == 3 and all(same(a[0], expected[0]) for a in answers)
        assert same(client.translate_hypotheses(["seven"], max_new_tokens=5)[0], expected[0])
        assert server.metrics.value("tfserve_requests_total",
                                    {"rpc": "Translate", "code": "RESOURCE_EXHAUSTED"}) == 9


BAD_REQUESTS = [
    (dict(texts=[]), "texts must not be empty"),
    (dict(texts=["seven"] * 257), "texts holds 257 items"),
    (dict(texts=["seven", "  "]), "texts[1] is empty"),
    # (a text over the source limit is split into pieces now, not refused: issue 36; its
    # refusal with split_sentences=false is tests/serving/test_documents.py's)
    (dict(texts=["seven"], num_beams=40), "options.num_beams"),
    (dict(texts=["seven"], num_beams=9), "options.num_beams is 9, over the server's max batch"),
    (dict(texts=["seven"], num_return_sequences=3, num_beams=2), "options.num_return_sequences"),
    (dict(texts=["seven"], max_new_tokens=1000), "options.max_new_tokens"),
    (dict(texts=["seven"], max_new_tokens=-1), "options.max_new_tokens"),
    (dict(texts=["seven"], min_new_tokens=9, max_new_tokens=4), "options.min_new_tokens"),
    (dict(texts=["seven"], do_sample=True, temperature=0.0), "options.temperature"),
    (dict(texts=["seven"], do_sample=True, top_p=1.5), "options.top_p"),
    (dict(texts=["seven"], top_k=-2), "options.top_k"),
    (dict(texts=["seven"], do_sample=True, seed=-1), "options.seed"),
    (dict(texts=["seven"], do_sample=True, num_beams=2), "options.num_beams"),
    (dict(texts=["seven"], token_ids=[[5]]), "texts and token_ids are mutually exclusive"),
    (dict(token_ids=[[5, 999]]), "token_ids[0].ids[1] is 999"),
    (dict(token_ids=[[5], []]), "token_ids[1] is empty"),
    (dict(token_ids=[[5] * 200]), "token_ids[0] is 201 tokens"),
]


def test_bad_input_is_invalid_argument(client: Client) -> None:
    for kwargs, message in BAD_REQUESTS:
        for call in (client.translate, lambda **kw: list(client.translate_stream(**kw))):
            with pytest.raises(ServerError) as error:
                call(**kwargs)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
            assert message in error.value.details(), (kwargs, error.value.details())
    for kwargs, message in [(dict(texts=["seven"], pooling="median"), "pooling must be one of"),
                            (dict(texts=[""]), "texts[0] is empty"),
                            (dict(texts=["seven " * 200]), "texts[0] is ")]:
        with pytest.raises(ServerError) as error:
            client.encode(**kwargs)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details()
    # truncate turns the over-long input into a valid one; the server still answers
    assert len(client.translate(["seven " * 200], truncate=True, max_new_tokens=3)) == 1
    assert len(client.encode(["seven " * 200], truncate=True)[0].token_ids) == 128
    assert len(client.translate(["seven"], max_new_tokens=3)) == 1


def test_model_failure_is_internal_for_that_batch_only(random_model: Path,
                                                       random_runtime: Any) -> None:
    """A failed encoder run fails only the requests it was encoding, not the batch decoding
    meanwhile (the worker is held before a step of that batch until the new request is
    queued, and it joins at the next step: no waits for company); a failed decoder step
    fails the requests in that batch; a failed Encode run fails its request; then the
    server goes on as before."""
    with ServerThread(server_args(random_model, "--max-batch-size", "8", "--max-wait-ms", "0",
                                  "--wave-wait-steps", "0"),
                      runtime=random_runtime) as server, Client(server.target) as client:
        long = dict(max_new_tokens=30, min_new_tokens=30)
        expected = client.translate_hypotheses(["seven"], **long)
        with Gate(server.scheduler) as gate, ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.translate_hypotheses, ["seven"], **long)
            gate.wait_held()
            gate.fail_next("encode")  # the next request's encoder batch fails ...
            failing = pool.submit(client.translate, ["eight"], max_new_tokens=3)
            wait_queued(server.scheduler, 1)
            gate.open()
            with pytest.raises(ServerError) as failed:
                failing.result(60)
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert "injected encode failure" in failed.value.details()
            assert same(running.result(60)[0], expected[0])  # ... not the running one
            # the failed run came while "seven" decoded, after a step and before its last
            encode = gate.calls.index(("encode", 1))
            assert 0 < sum(stage == "step" for stage, _ in gate.calls[:encode]) < 30
            # a failed decoder step fails the requests in that batch, then the server goes on
            gate.fail_next("step")
            with pytest.raises(ServerError) as failed:
                client.translate(["nine"], max_new_tokens=3)
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            gate.fail_next("embed")
            with pytest.raises(ServerError) as failed:
                client.encode(["nine"])
            assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert same(client.translate_hypotheses(["seven"], **long)[0], expected[0])
        assert server.scheduler.stats.model_errors == 3
        assert server.metrics.value("tfserve_model_errors_total", {"stage": "step"}) == 1


# -- operations -----------------------------------------------------------------------------


def test_health_and_reflection_with_generic_stubs(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tfserve.v1.Translator"):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=60)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(reflection.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="tfserve.v1.Translator"),
            reflection_pb2.ServerReflectionRequest(  # the Open Inference Protocol's too
                file_containing_symbol="inference.GRPCInferenceService")]),
            timeout=60))
        names = {s.name for s in responses[0].list_services_response.service}
        assert {"tfserve.v1.Translator", "inference.GRPCInferenceService",
                "grpc.health.v1.Health"} <= names
        assert responses[1].file_descriptor_response.file_descriptor_proto
        described = descriptor_pb2.FileDescriptorProto.FromString(
            responses[2].file_descriptor_response.file_descriptor_proto[0])
        assert "GRPCInferenceService" in [service.name for service in described.service]


def test_metrics_endpoint(server: ServerThread, client: Client) -> None:
    client.translate(["seven"], max_new_tokens=3)
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=60) as response:
        text = response.read().decode()
    for name in ("tfserve_requests_total", "tfserve_queue_seconds_bucket",
                 "tfserve_decoder_batch_rows_bucket", "tfserve_generated_tokens_total",
                 "tfserve_decoder_step_seconds_bucket", "tfserve_in_flight_requests",
                 "tfserve_queue_depth"):
        assert name in text
    assert 'tfserve_requests_total{code="OK",rpc="Translate"}' in text


def test_auth_token(random_model: Path, random_runtime: Any) -> None:
    with ServerThread(server_args(random_model, "--auth-token", "s3cret"),
                      runtime=random_runtime) as server:
        with Client(server.target, timeout=60) as anonymous:
            assert anonymous.health() == "SERVING"  # health is exempt
            for call in (lambda: anonymous.translate(["seven"]),
                         lambda: list(anonymous.translate_stream(["seven"])),
                         anonymous.model_info):
                with pytest.raises(ServerError) as error:
                    call()
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(server.target, timeout=60, token="wrong") as wrong:
            with pytest.raises(ServerError):
                wrong.translate(["seven"])
        with Client(server.target, timeout=60, token="s3cret") as authorized:
            assert len(authorized.translate(["seven"], max_new_tokens=2)) == 1


def test_tls(random_model: Path, random_runtime: Any, tmp_path: Path) -> None:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with ServerThread(server_args(random_model, "--tls-cert", str(cert), "--tls-key", str(key)),
                      runtime=random_runtime) as server:
        with Client(server.target, timeout=60, root_certificates=cert.read_bytes()) as secure:
            assert len(secure.translate(["seven"], max_new_tokens=2)) == 1
        with Client(server.target, timeout=60) as plaintext:  # refused, not timed out
            with pytest.raises(ServerError) as error:
                plaintext.translate(["seven"])
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_max_message_size(random_model: Path, random_runtime: Any) -> None:
    with ServerThread(server_args(random_model, "--max-message-bytes", "2000"),
                      runtime=random_runtime) as server, Client(server.target,
                                                                timeout=60) as client:
        with pytest.raises(ServerError) as error:
            client.translate(["seven"] * 250)  # about 2.3 kB on the wire
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(ServerError) as error:  # 8 x 16 x 32 floats back: too big to send
            client.encode([TEXTS[6]] * 8, per_token=True)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(client.translate(["seven"], max_new_tokens=2)) == 1


def test_flags_and_env_vars() -> None:
    from tfserve.serving.settings import parse_config

    env = {"TFSERVE_PORT": "6000", "TFSERVE_MAX_QUEUE": "7", "TFSERVE_MODEL": "/models/x",
           "TFSERVE_MAX_WAIT_MS": "0.5"}
    config = parse_config(["--port", "6001"], environ=env)
    assert config.port == 6001 and config.max_queue == 7 and config.max_wait_ms == 0.5
    assert str(config.model) == "/models/x"
    assert parse_config([], environ={}).port == 50051
    with pytest.raises(SystemExit):
        parse_config([], environ={"TFSERVE_PORT": "many"})
    with pytest.raises(SystemExit):
        parse_config(["--tls-cert", "c.pem"], environ={})
    assert parse_config([], environ={}).encode_ahead is False
    assert parse_config([], environ={"TFSERVE_ENCODE_AHEAD": "on"}).scheduler_config().encode_ahead
    assert parse_config(["--encode-ahead", "false"],
                        environ={"TFSERVE_ENCODE_AHEAD": "1"}).encode_ahead is False
    with pytest.raises(SystemExit):
        parse_config(["--encode-ahead", "maybe"], environ={})
    assert parse_config([], environ={}).event_loop == "auto"
    with pytest.raises(SystemExit):
        parse_config(["--event-loop", "trio"], environ={})


def test_event_loop_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto takes uvloop when installed, else asyncio; asking for a missing uvloop is an
    error naming the flag."""
    import sys

    from tfserve.serving.process_tuning import event_loop_runner

    assert event_loop_runner("asyncio") is asyncio.run
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        assert event_loop_runner("auto") is uvloop.run
        assert event_loop_runner("uvloop") is uvloop.run
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    assert event_loop_runner("auto") is asyncio.run
    with pytest.raises(ValueError, match="--event-loop uvloop"):
        event_loop_runner("uvloop")


def test_graceful_drain_on_sigterm(random_model: Path) -> None:
    """SIGTERM to a serving process: health goes NOT_SERVING, new calls get UNAVAILABLE, the
    calls it had received are answered in full, and it exits 0. The server's decoder steps
    are held (ProcessGate) from before the calls are sent until the drain has begun, so the
    four calls are provably in flight when it starts, queued or decoding."""
    from tfserve.client import translate_request

    with ProcessGate() as gate:
        process = ServerProcess(server_args(random_model, "--max-batch-size", "2",
                                            "--grace-seconds", "30"), gate=gate)
        try:
            target = process.wait_serving()
            gate.hold()
            with Client(target, timeout=60) as client:
                stub = pb2_grpc.TranslatorStub(client.channel)
                long = dict(max_new_tokens=20, min_new_tokens=20)
                streams = [stub.TranslateStream(translate_request(TEXTS[i : i + 6], **long),
                                                timeout=60) for i in range(4)]
                for stream in streams:
                    stream.initial_metadata()  # sent once the call is queued
                process.proc.send_signal(signal.SIGTERM)
                draining = process.wait_for(lambda record: record.get("event") == "draining")
                assert draining["in_flight"] == 4
                assert client.health() == "NOT_SERVING"
                with pytest.raises(ServerError) as rejected:
                    client.translate(["seven"], max_new_tokens=2)
                assert rejected.value.code() == grpc.StatusCode.UNAVAILABLE
                gate.release()
                chunks = [list(stream) for stream in streams]
            for i, received in enumerate(chunks):
                finals = [chunk.final for chunk in received if chunk.done]
                assert len(finals) == len(TEXTS[i : i + 6])
                assert all(len(f.token_ids) == 20 for f in finals)
            assert process.proc.wait(30) == 0
            records = process.records()
            assert [r for r in records if r.get("event") == "stopped"]
            statuses = [r.get("status") for r in records if r.get("rpc") == "TranslateStream"]
            assert statuses == ["OK"] * 4
            assert "UNAVAILABLE" in [r.get("status") for r in records
                                     if r.get("rpc") == "Translate"]
        finally:
            process.kill()


def test_drain_finishes_the_calls_in_flight(random_model: Path, random_runtime: Any) -> None:
    """The model is held (a hook blocks the worker) while the drain starts: the calls are
    provably in flight, and the drain waits for them and answers them in full."""
    with ServerThread(server_args(random_model, "--max-batch-size", "4"),
                      runtime=random_runtime) as running:
        with Client(running.target, timeout=60) as client, ThreadPoolExecutor(4) as pool, \
                Gate(running.scheduler) as gate:
            long = dict(max_new_tokens=20, min_new_tokens=20)
            calls = [pool.submit(client.translate_hypotheses, [text], **long)
                     for text in TEXTS[:3]]
            gate.wait_held()
            running.wait_until(lambda: running.in_flight == 3)
            drain = pool.submit(running.run_on_loop, running.server.drain, 60)
            running.wait_until(lambda: running.core.calls.draining)
            assert not any(call.done() for call in calls)
            gate.open()
            answers = [call.result(60) for call in calls]
            drain.result(60)
        assert all(len(a[0][0].token_ids) == 20 for a in answers)
        assert running.metrics.value("tfserve_requests_total",
                                     {"rpc": "Translate", "code": "OK"}) == 3


def test_loadgen_smoke(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.bench.loadgen import english_number, main

    assert english_number(342) == "three hundred and forty-two"
    assert english_number(8005) == "eight thousand and five"
    # --duration is a safety net: the runs end when their requests are done
    code = main(["--server", server.target, "--concurrency", "1,4", "--requests", "8",
                 "--duration", "600", "--max-new-tokens", "4", "--warmup", "1", "--json",
                 "--connections", "4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 2 and '"concurrency": 4' in lines[1]
    assert main(["--server", "192.0.2.1:50051"]) == 2  # not loopback
    assert main(["--server", server.target, "--rounds", "2"]) == 2  # needs --offline
    # the floor: Health.Check through the same server, no texts, no tokens
    capsys.readouterr()
    code = main(["--server", server.target, "--rpc", "health", "--concurrency", "2",
                 "--requests", "20", "--duration", "600", "--warmup", "0", "--json"])
    floor = json.loads(capsys.readouterr().out.strip())
    assert code == 0 and floor["requests"] == 20 and floor["errors"] == 0
    assert floor["texts"] == 0 and floor["tokens"] == 0 and floor["requests_per_s"] > 0
    assert main(["--server", server.target, "--rpc", "health", "--offline", "x"]) == 2
    assert main(["--server", server.target, "--connections", "-1"]) == 2


def test_loadgen_offline_figures_sorted_and_in_calls_of_32(random_model: Path) -> None:
    """The offline reference: every text in one call (sorted by the translator), then the same
    texts in calls of 32 in arrival order, then single texts; each call is warmed up first."""
    from tfserve.bench.loadgen import number_phrases, offline_figures, offline_translator

    translator = offline_translator(random_model, 1)
    sizes: list[int] = []
    translate = translator.translate_hypotheses

    def counted(texts: list[str], **options: Any) -> Any:
        sizes.append(len(texts))
        return translate(texts, **options)

    translator.translate_hypotheses = counted
    figures = offline_figures(translator, number_phrases(100), {"max_new_tokens": 2}, count=70)
    assert sizes == [32, 70, 32, 32, 32, 6] + [1] * 64
    assert figures["batch32_tokens_per_s"] > 0 and figures["calls32_tokens_per_s"] > 0
    assert figures["single_p50_ms"] > 0 and figures["batch32_cpu_ms_per_text"] > 0


def test_loadgen_rounds_bracket_each_served_run_with_offline_runs() -> None:
    """drift_rounds: offline, served, offline, ...; each ratio uses the two offline runs
    around its served run (a machine that slows down during the run does not bias it)."""
    from tfserve.bench.loadgen import drift_rounds

    calls: list[str] = []
    speed = iter([100.0, 80.0, 60.0, 40.0])  # the machine slows down run after run
    served = iter([90.0, 63.0, 45.0])

    def offline() -> float:
        calls.append("offline")
        return next(speed)

    def serve() -> float:
        calls.append("served")
        return next(served)

    rounds = drift_rounds(3, serve, offline)
    assert calls == ["offline", "served"] * 3 + ["offline"]
    assert rounds["ratios"] == [1.0, 0.9, 0.9] and rounds["median_ratio"] == 0.9


def test_proto_build_is_reproducible(tmp_path: Path) -> None:
    from tfserve.proto import build as proto_build

    assert not proto_build.is_stale()
    written = proto_build.build(out_dir=tmp_path)
    names = sorted(p.name for p in written)
    assert "translator_pb2.py" in names and "translator_pb2_grpc.py" in names
    grpc_module = next(p for p in written if p.name == "translator_pb2_grpc.py").read_text()
    assert "from tfserve.proto.tfserve.v1 import translator_pb2" in grpc_module
    assert not proto_build.is_stale(out_dir=tmp_path)


def test_serving_path_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, tfserve.server.main, tfserve.client, tfserve.scheduler, "
            "tfserve.bench.loadgen, tfserve.server.worker_processes; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
                          ).returncode == 0



def test_keep_freed_memory_respects_the_operators_malloc_settings() -> None:
    """glibc keeps freed blocks for the next join, unless MALLOC_* variables say otherwise
    (checked in child processes: the setting is process-wide)."""
    import platform
    import subprocess
    import sys

    code = ("from tfserve.serving.process_tuning import keep_freed_memory; "
            "print(keep_freed_memory())")
    clean = {name: value for name, value in os.environ.items()
             if not name.startswith("MALLOC_")}
    for extra, expected in (({"MALLOC_ARENA_MAX": "2"}, "False"), ({}, "True")):
        if expected == "True" and not (platform.system() == "Linux"
                                       and platform.libc_ver()[0] == "glibc"):
            continue
        out = subprocess.run([sys.executable, "-c", code], env={**clean, **extra},
                             capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() == expected
