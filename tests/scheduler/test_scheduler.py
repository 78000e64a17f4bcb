"""The scheduler driven step by step over a numpy fake backend: no thread, no sleeps, no model.

`Scheduler.run_once()` is one pass of the worker loop; the tests call it themselves and
assert on what each pass admits, steps and retires, and on how every request ends when the
backend fails at any call. The batching policy is also driven on its own, on a fake clock:
what it admits, what it holds and when the wait for company ends.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from fake_backend import EOS, FakeBackend, FaultyBackend, InjectedFault

import tfserve.scheduler.encoding as encoding_module
from tfserve.generation import DecodingOptions
from tfserve.generation.batch import generate
from tfserve.scheduler import (
    BatchingPolicy,
    Cancelled,
    DeadlineExceeded,
    Job,
    ModelError,
    QueueFull,
    Running,
    Scheduler,
    SchedulerConfig,
    Take,
    TakeMode,
    WorkItem,
)


class FakeClock:
    """A clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(backend: FakeBackend | None = None, clock: FakeClock | None = None,
                   **config: object) -> Scheduler:
    settings = dict(max_batch_size=8, max_wait_ms=0.0, wave_wait_steps=0)
    settings.update(config)
    return Scheduler(backend or FakeBackend(), SchedulerConfig(**settings),  # type: ignore[arg-type]
                     clock=clock or FakeClock())


def drive(scheduler: Scheduler, jobs: list[Job], limit: int = 2000) -> int:
    """run_once until every job has ended; returns the passes it took."""
    for passes in range(1, limit + 1):
        if all(job.done for job in jobs) and scheduler.idle:
            return passes
        scheduler.run_once()
    raise AssertionError(f"jobs still open after {limit} passes: "
                         f"{[job.id for job in jobs if not job.done]}")


def answer(job: Job) -> list[list[tuple[list[int], float]]]:
    return [[(h.token_ids, round(h.score, 4)) for h in hyps] for hyps in job.result(0)]


def alone(source: list[int], options: DecodingOptions) -> list[list[tuple[list[int], float]]]:
    """What the request gets with the batch to itself (offline generate)."""
    ids = np.array([source], np.int64)
    hyps = generate(FakeBackend(), ids, np.ones_like(ids), options)
    return [[(h.token_ids, round(h.score, 4)) for h in hyps[0]]]


OPTIONS = [
    DecodingOptions(max_new_tokens=12),
    DecodingOptions(max_new_tokens=12, num_beams=3, num_return_sequences=2),
    DecodingOptions(max_new_tokens=12, num_beams=2, length_penalty=0.6),
    DecodingOptions(max_new_tokens=12, do_sample=True, top_k=4, seed=7),
    DecodingOptions(max_new_tokens=12, do_sample=True, num_return_sequences=2, seed=3,
                    temperature=0.7),
    DecodingOptions(max_new_tokens=3, min_new_tokens=2),
]


def random_source(rng: random.Random) -> list[int]:
    return [rng.randint(2, 15) for _ in range(rng.randint(1, 6))] + [EOS]


# -- the fake backend itself ------------------------------------------------------------------


def test_fake_backend_answers_depend_on_the_source_only() -> None:
    """The premise of every test below: a request's answer is the same alone and in a batch."""
    rng = random.Random(0)
    sources = [random_source(rng) for _ in range(6)]
    width = max(map(len, sources))
    ids = np.zeros((len(sources), width), np.int64)
    mask = np.zeros_like(ids)
    for row, source in enumerate(sources):
        ids[row, : len(source)] = source
        mask[row, : len(source)] = 1
    together = generate(FakeBackend(), ids, mask, OPTIONS)
    for row, source in enumerate(sources):
        assert [[(h.token_ids, round(h.score, 4)) for h in together[row]]] == alone(
            source, OPTIONS[row])
    assert together[0][0].token_ids, "the answers are not empty"
    assert len(together[0][0].token_ids) == sources[0][0] % 7 + 1


# -- step by step -------------------------------------------------------------------------------


def test_each_pass_admits_what_fits_and_retires_what_finished() -> None:
    """Beam-2 requests reserve 2 rows each: with 4 rows, two start, the third waits for the
    first to finish, then joins at the next pass."""
    scheduler = make_scheduler(max_batch_size=4)
    beams = DecodingOptions(max_new_tokens=12, num_beams=2)
    short, long_a, long_b = [2, EOS], [6, 3, EOS], [5, 4, EOS]  # answers of 3, 7, 6 tokens
    jobs = [scheduler.submit_translate([source], beams) for source in (short, long_a, long_b)]
    scheduler.run_once()
    assert len(scheduler._batch) == 2 and len(scheduler.policy.translate_queue) == 1
    passes = 1
    while not jobs[0].done:
        assert len(scheduler.policy.translate_queue) == 1, "the third waits: no rows are free"
        scheduler.run_once()
        passes += 1
    assert passes == 4  # 3 tokens + eos: four steps
    scheduler.run_once()
    assert not scheduler.policy.translate_queue and len(scheduler._batch) == 2
    drive(scheduler, jobs)
    for job, source in zip(jobs, (short, long_a, long_b), strict=True):
        assert answer(job) == alone(source, beams)
    assert scheduler.idle


def test_a_request_cancelled_mid_decoding_leaves_at_the_next_pass() -> None:
    scheduler = make_scheduler()
    options = DecodingOptions(max_new_tokens=12)
    kept = scheduler.submit_translate([[6, EOS]], options)
    cancelled = scheduler.submit_translate([[6, 3, EOS]], options)
    scheduler.run_once()
    assert len(scheduler._batch) == 2
    cancelled.cancel()
    scheduler.run_once()
    assert len(scheduler._batch) == 1
    assert isinstance(cancelled.future.exception(0), Cancelled)
    drive(scheduler, [kept])
    assert answer(kept) == alone([6, EOS], options)
    assert scheduler.stats.freed_rows == {"cancelled": 1}


def test_deadlines_are_read_from_the_injected_clock() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(clock=clock)
    options = DecodingOptions(max_new_tokens=12)
    expires = scheduler.submit_translate([[6, EOS]], options, deadline=clock() + 1.0)
    lasts = scheduler.submit_translate([[6, EOS]], options, deadline=clock() + 100.0)
    scheduler.run_once()
    scheduler.run_once()
    assert not expires.done
    clock.now += 1.0
    scheduler.run_once()
    assert isinstance(expires.future.exception(0), DeadlineExceeded)
    drive(scheduler, [lasts])
    assert answer(lasts) == alone([6, EOS], options)
    assert lasts.queue_seconds == 0.0  # admitted on the first pass, by the fake clock


def test_streaming_events_add_up_to_the_answer() -> None:
    scheduler = make_scheduler()
    events = []
    options = DecodingOptions(max_new_tokens=12)
    job = scheduler.submit_translate([[5, 9, EOS]], options, on_event=events.append)
    drive(scheduler, [job])
    assert events[-1].done
    streamed = [token for event in events for token in event.token_ids]
    assert streamed == job.result(0)[0][0].token_ids


# -- one request's failure is its own -----------------------------------------------------------


def test_a_search_that_raises_fails_only_its_own_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside one search (its own options, its own numbers) ends that request with
    an error; the others in the same steps get their answers, equal to their answers alone."""
    real_make_search = encoding_module.make_search
    poisoned = DecodingOptions(max_new_tokens=12, num_beams=2, length_penalty=0.5)

    def make_search(options: DecodingOptions, eos: int, start: int):  # type: ignore[no-untyped-def]
        search = real_make_search(options, eos, start)
        if options is poisoned:
            def advance(*args: object, **kwargs: object) -> None:
                raise ZeroDivisionError("float division by zero")

            search.advance = search.advance_candidates = advance  # type: ignore[method-assign]
        return search

    monkeypatch.setattr(encoding_module, "make_search", make_search)
    scheduler = make_scheduler()
    rng = random.Random(1)
    sources = [random_source(rng) for _ in range(5)]
    good = [scheduler.submit_translate([source], OPTIONS[i]) for i, source in enumerate(sources)]
    bad = scheduler.submit_translate([[7, 7, EOS]], poisoned)
    drive(scheduler, good + [bad])
    error = bad.future.exception(0)
    assert isinstance(error, ModelError) and "ZeroDivisionError" in str(error)
    for i, job in enumerate(good):
        assert answer(job) == alone(sources[i], OPTIONS[i])
    assert scheduler.metrics.value("tfserve_model_errors_total", {"stage": "search"}) == 1


def test_an_encoder_input_that_fails_fails_only_its_own_request() -> None:
    """An encoder run that fails is tried again input by input: only the input the model
    cannot take fails."""

    class RefusesToken13(FakeBackend):
        def encode(self, input_ids, attention_mask):  # type: ignore[no-untyped-def]
            if (input_ids == 13).any():
                raise InjectedFault("token 13")
            return super().encode(input_ids, attention_mask)

    scheduler = make_scheduler(RefusesToken13())
    options = DecodingOptions(max_new_tokens=12)
    sources = [[4, 2, EOS], [13, 2, EOS], [5, EOS]]
    jobs = [scheduler.submit_translate([source], options) for source in sources]
    drive(scheduler, jobs)
    assert isinstance(jobs[1].future.exception(0), ModelError)
    assert answer(jobs[0]) == alone(sources[0], options)
    assert answer(jobs[2]) == alone(sources[2], options)


def test_answers_decided_on_a_failing_step_are_delivered() -> None:
    """A search that finished on the step whose cache copy then failed has its answer: it is
    answered, not lost (before, it was neither answered nor failed)."""
    options = DecodingOptions(max_new_tokens=12)
    quick, slow = [2, EOS], [6, 3, EOS]  # 3 and 7 tokens
    probe = make_scheduler()
    jobs = [probe.submit_translate([source], options) for source in (quick, slow)]
    calls_before_last_step = None
    while not jobs[0].done:
        calls_before_last_step = probe.backend.calls
        probe.run_once()
    # fail every call after the step on which `quick` finished started
    backend = FaultyBackend()
    scheduler = make_scheduler(backend)
    jobs = [scheduler.submit_translate([source], options) for source in (quick, slow)]
    while backend.calls < calls_before_last_step:
        scheduler.run_once()
    backend.fail_ops = {"take_rows", "concat_rows", "slice_time"}
    backend.fail_at = {backend.calls + 2}  # the call after the step's own run
    drive(scheduler, jobs)
    assert answer(jobs[0]) == alone(quick, options)


def test_every_request_ends_once_whatever_call_fails() -> None:
    """Fault injection at every backend call of a busy run (encoder runs, decoder steps, joins,
    row copies, compactions), with cancellations and deadlines: every request ends with one
    answer or one error, every answer equals the request's answer alone, and the scheduler
    serves correctly afterwards."""
    rng = random.Random(5)
    plan = []
    for index in range(14):
        options = replace(rng.choice(OPTIONS))
        plan.append((index, [random_source(rng) for _ in range(rng.randint(1, 2))], options,
                     rng.choice([None, None, "cancel", "deadline"]), rng.randint(0, 6)))
    expected = {index: [alone(source, options)[0] for source in sources]
                for index, sources, options, _, _ in plan}

    def run(backend: FakeBackend) -> dict[int, Job]:
        clock = FakeClock()
        scheduler = make_scheduler(backend, clock, max_batch_size=6)
        jobs: dict[int, Job] = {}
        for turn in range(200):
            for index, sources, options, fate, arrival in plan:
                if arrival == turn:
                    deadline = clock() + 3.0 if fate == "deadline" else None
                    jobs[index] = scheduler.submit_translate(sources, options, deadline=deadline)
                if fate == "cancel" and arrival + 2 == turn and index in jobs:
                    jobs[index].cancel()
            scheduler.run_once()
            clock.now += 1.0
            if len(jobs) == len(plan) and all(job.done for job in jobs.values()):
                break
        assert all(job.done for job in jobs.values()), "a request was never answered"
        # the scheduler still serves, and correctly
        backend.fail_at, backend.fail_ops = set(), set()  # type: ignore[attr-defined]
        after = scheduler.submit_translate([[3, 4, EOS]], OPTIONS[1])
        drive(scheduler, [after])
        assert answer(after) == alone([3, 4, EOS], OPTIONS[1])
        return jobs

    clean = FakeBackend()
    baseline = run(clean)
    total_calls = clean.calls
    for index, job in baseline.items():
        if job.future.exception(0) is None:
            assert answer(job) == expected[index]
    assert total_calls > 50
    outcomes = {"answered": 0, "model_error": 0}
    for fail_at in range(1, total_calls + 1):
        backend = FaultyBackend({fail_at})
        jobs = run(backend)
        for index, job in jobs.items():
            error = job.future.exception(0)
            if error is None:
                outcomes["answered"] += 1
                assert answer(job) == expected[index], (fail_at, backend.faults, index)
            else:
                assert isinstance(error, (ModelError, Cancelled, DeadlineExceeded)), error
                outcomes["model_error"] += isinstance(error, ModelError)
    assert outcomes["answered"] and outcomes["model_error"]


def test_rows_the_decoder_cannot_take_fail_only_their_request() -> None:
    """A decoder run that fails for one request's rows (here: a source token the model
    refuses) is tried member by member on copies: only that request fails, the others step on
    and get their lone answers. A run that fails for every member alone fails them all."""

    class RefusesToken13InSteps(FakeBackend):
        def step(self, input_ids, position_ids, self_attention_mask,  # type: ignore[no-untyped-def]
                 encoder_attention_mask, past, cross):
            if (cross[0] == 13).any():
                raise InjectedFault("token 13 in a step")
            return super().step(input_ids, position_ids, self_attention_mask,
                                encoder_attention_mask, past, cross)

    scheduler = make_scheduler(RefusesToken13InSteps())
    sources = [[4, 2, EOS], [13, 2, EOS], [5, EOS], [6, 3, 2, EOS]]
    options = [OPTIONS[0], OPTIONS[1], OPTIONS[2], OPTIONS[3]]
    jobs = [scheduler.submit_translate([source], option)
            for source, option in zip(sources, options, strict=True)]
    drive(scheduler, jobs)
    assert isinstance(jobs[1].future.exception(0), ModelError)
    for index in (0, 2, 3):
        assert answer(jobs[index]) == alone(sources[index], options[index])
    assert scheduler.metrics.value("tfserve_model_errors_total", {"stage": "step"}) == 1

    # every member fails alone: the run's failure is everybody's
    scheduler = make_scheduler(FaultyBackend(fail_ops={"step"}))
    jobs = [scheduler.submit_translate([source], OPTIONS[0]) for source in ([4, EOS], [5, EOS])]
    drive(scheduler, jobs)
    assert all(isinstance(job.future.exception(0), ModelError) for job in jobs)


# -- the batching policy on its own: no worker, no model --------------------------------------


def make_policy(clock: FakeClock, **config: object) -> BatchingPolicy:
    settings = dict(max_batch_size=8, max_wait_ms=2.0, wave_wait_steps=4)
    settings.update(config)
    return BatchingPolicy(SchedulerConfig(**settings), clock)  # type: ignore[arg-type]


def arrive(policy: BatchingPolicy, clock: FakeClock, rows: int = 1, inputs: int = 1,
           kind: str = "translate", deadline: float | None = None) -> list[WorkItem]:
    """Queue a request of `inputs` inputs reserving `rows` rows each (as Scheduler.submit_*
    does); its items."""
    options = DecodingOptions(max_new_tokens=5) if kind == "translate" else None
    job = Job(kind, options, deadline, submitted=clock())
    items = [WorkItem(job, index, [3, EOS], rows) for index in range(inputs)]
    job.results = [None] * inputs
    job.remaining = job.unadmitted = inputs
    policy.add(job, items)
    return items


def decoding(rows: int) -> Running:
    """The worker decoding one request of `rows` rows."""
    job = Job("translate", DecodingOptions(max_new_tokens=5), None, submitted=0.0)
    return Running(decoding=[WorkItem(job, 0, [3, EOS], rows)])


IDLE = Running()


def test_policy_starts_a_lone_request_at_once() -> None:
    clock = FakeClock()
    policy = make_policy(clock)
    items = arrive(policy, clock)
    assert policy.batching_wait(IDLE) == 0
    assert policy.take(IDLE) == Take(items, [], TakeMode.JOIN, [])
    assert not policy.queued and policy.queued_jobs == 0
    assert items[0].job.queue_seconds == 0.0


def test_policy_gathers_arrivals_at_a_running_batch_for_max_wait_ms() -> None:
    """With rows decoding, arrivals wait up to max_wait_ms after the first of them, or until
    they fill the free rows, and then join together."""
    clock = FakeClock()
    policy = make_policy(clock, wave_wait_steps=0)  # 2 ms
    running = decoding(5)  # 3 rows free
    start = clock()
    first = arrive(policy, clock)
    assert policy.batching_wait(running) == pytest.approx(0.002)
    assert policy.take(running) == Take([], [], TakeMode.HOLD, [])
    clock.now += 0.001
    second = arrive(policy, clock)
    assert policy.batching_wait(running) == pytest.approx(0.001)  # from the first arrival
    assert policy.take(running).mode is TakeMode.HOLD
    clock.now = start + 0.002
    assert policy.batching_wait(running) == 0
    assert policy.take(running) == Take(first + second, [], TakeMode.JOIN, [])
    assert first[0].job.queue_seconds == pytest.approx(0.002)
    assert second[0].job.queue_seconds == pytest.approx(0.001)
    # arrivals that fill the free rows do not wait for the time to pass
    both = arrive(policy, clock, inputs=2) + arrive(policy, clock)
    assert policy.batching_wait(running) == 0
    assert policy.take(running) == Take(both, [], TakeMode.JOIN, [])


def test_policy_waits_for_the_rows_that_just_finished_to_come_back() -> None:
    """Three 1-row requests succeeded: arrivals wait until three rows are queued (closed-loop
    clients coming back), then join as one group; the record of the freed rows is used up."""
    clock = FakeClock()
    policy = make_policy(clock)  # wait up to max(2 ms, 4 steps)
    policy.record_step(0.010)
    assert policy.step_seconds == 0.010
    policy.record_step(0.020)
    assert policy.step_seconds == pytest.approx(0.012)  # a running mean, recent steps weigh
    policy.record_success(clock(), 3)
    clock.now += 0.005
    wave = arrive(policy, clock)
    assert policy.batching_wait(IDLE) == pytest.approx(4 * 0.012)
    assert policy.take(IDLE).mode is TakeMode.HOLD
    clock.now += 0.001
    wave += arrive(policy, clock)
    assert policy.take(IDLE).mode is TakeMode.HOLD
    wave += arrive(policy, clock)
    assert policy.batching_wait(IDLE) == 0
    assert policy.take(IDLE) == Take(wave, [], TakeMode.JOIN, [])
    assert not policy.freed
    # nothing finished since: the next request starts at once
    lone = arrive(policy, clock)
    assert policy.take(IDLE) == Take(lone, [], TakeMode.JOIN, [])


def test_policy_wait_for_returning_rows_ends_after_wave_wait_steps() -> None:
    clock = FakeClock()
    policy = make_policy(clock, wave_wait_steps=2)
    policy.record_step(0.010)
    start = clock()
    policy.record_success(start, 3)
    first = arrive(policy, clock)
    clock.now = start + 0.019
    assert policy.take(IDLE).mode is TakeMode.HOLD
    clock.now = start + 2 * 0.010  # 2 steps after the first arrival
    assert policy.take(IDLE) == Take(first, [], TakeMode.JOIN, [])
    assert list(policy.freed) == [(start, 2)]  # one of the three rows came back
    # much later, the two rows that never came back are forgotten: no wait
    clock.now += 1.0
    late = arrive(policy, clock)
    assert policy.batching_wait(IDLE) == 0
    assert policy.take(IDLE) == Take(late, [], TakeMode.JOIN, [])
    assert not policy.freed


def test_policy_encodes_ahead_while_the_idle_worker_waits() -> None:
    """encode_ahead: an idle worker waiting for returning rows takes each arrival to encode
    it ("ahead"); the items it holds reserve their rows (unless their request ended), and
    the arrival that completes the wave joins with them ("join")."""
    clock = FakeClock()
    policy = make_policy(clock, encode_ahead=True)
    policy.record_step(0.010)
    policy.record_success(clock(), 2)
    first = arrive(policy, clock, rows=1)
    assert policy.may_encode_ahead(IDLE)
    assert policy.take(IDLE) == Take(first, [], TakeMode.AHEAD, [])
    held = Running(ahead=first)
    assert policy.reserved_rows(held) == 1
    assert policy.batching_wait(held) == pytest.approx(0.040)  # still waiting for company
    clock.now += 0.001
    second = arrive(policy, clock)
    assert policy.take(held) == Take(second, [], TakeMode.JOIN, [])  # the worker joins first too
    # a held item whose request was cancelled reserves nothing
    first[0].job.cancel()
    assert policy.reserved_rows(held) == 0
    # with rows decoding, arrivals are held, not encoded ahead
    policy.record_success(clock(), 2)
    queued = arrive(policy, clock)
    assert not policy.may_encode_ahead(decoding(1))
    assert policy.take(decoding(1)) == Take([], [], TakeMode.HOLD, [])
    clock.now += 0.050
    assert policy.take(decoding(1)) == Take(queued, [], TakeMode.JOIN, [])


def test_policy_admission_is_fifo_without_overtaking() -> None:
    """A 4-row beam search at the head that does not fit waits for rows; the 1-row request
    behind it, which would fit, does not overtake it."""
    clock = FakeClock()
    policy = make_policy(clock, max_wait_ms=0.0, wave_wait_steps=0)
    beam = arrive(policy, clock, rows=4)
    greedy = arrive(policy, clock, rows=1)
    assert policy.take(decoding(5)) == Take([], [], TakeMode.JOIN, [])
    assert list(policy.translate_queue) == beam + greedy
    assert policy.take(decoding(4)) == Take(beam, [], TakeMode.JOIN, [])  # 8 rows: full
    assert policy.take(decoding(7)) == Take(greedy, [], TakeMode.JOIN, [])


def test_policy_never_holds_encode_requests() -> None:
    """While translate arrivals wait for returning rows, Encode requests start at once, at
    most max_batch_size inputs a pass; a request leaves the queue with its last input."""
    clock = FakeClock()
    policy = make_policy(clock)
    policy.record_step(0.010)
    policy.record_success(clock(), 4)
    translate = arrive(policy, clock)
    encode = arrive(policy, clock, inputs=10, kind="encode")
    assert policy.batching_wait(IDLE) == 0
    assert policy.take(IDLE) == Take([], encode[:8], TakeMode.HOLD, [])
    assert policy.queued_jobs == 2
    assert policy.take(IDLE) == Take([], encode[8:], TakeMode.HOLD, [])
    assert policy.queued_jobs == 1 and list(policy.translate_queue) == translate


def test_policy_drops_queued_items_of_requests_that_ended() -> None:
    clock = FakeClock()
    policy = make_policy(clock, max_wait_ms=0.0, wave_wait_steps=0)
    expiring = arrive(policy, clock, deadline=clock() + 1.0)
    cancelled = arrive(policy, clock)
    kept = arrive(policy, clock)
    cancelled[0].job.cancel()
    clock.now += 1.0
    taken = policy.take(decoding(8))  # no row free: only the dead leave
    assert taken == Take([], [], TakeMode.JOIN,
                         [(expiring[0], "deadline"), (cancelled[0], "cancelled")])
    assert isinstance(expiring[0].job.future.exception(0), DeadlineExceeded)
    assert list(policy.translate_queue) == kept and policy.queued_jobs == 1


def test_policy_refuses_requests_past_max_queue() -> None:
    clock = FakeClock()
    policy = make_policy(clock, max_queue=2)
    first = arrive(policy, clock)
    second = arrive(policy, clock)
    with pytest.raises(QueueFull, match="2 requests waiting"):
        arrive(policy, clock)
    assert policy.take(IDLE).translate == first + second
    arrive(policy, clock)  # both left the queue: room again
    arrive(policy, clock, inputs=3)
    assert len(policy.drain()) == 4  # on stop: every queued input, to be failed
    assert not policy.queued and policy.queued_jobs == 0
