"""The worker: one thread that owns the model and runs the scheduler's loop (`Scheduler`).

Each pass (`Scheduler.run_once`) drops the rows of cancelled, expired and failed requests,
takes what the batching policy lets start now (`BatchingPolicy.take`), encodes it in
length-sorted batches, joins it to the running `DecodeBatch`, and runs one decoder step,
streaming decided tokens and resolving finished requests. A failed model run fails the
requests it was for, never the worker: an encoder batch or a decoder run that fails is tried
again request by request, so that only the inputs the model cannot take fail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tfserve.generation import Backend, DecodingOptions, Hypothesis
from tfserve.generation.batch import BatchRunError, DecodeBatch, Joining
from tfserve.scheduler.encoding import EncoderRuns
from tfserve.scheduler.jobs import (
    Job,
    Outcomes,
    SchedulerStats,
    StreamEvent,
    Unavailable,
    WorkItem,
)
from tfserve.scheduler.policy import BatchingPolicy, Running, TakeMode
from tfserve.scheduler.scheduler_config import SchedulerConfig
from tfserve.telemetry.metrics import Metrics
from tfserve.text.inputs import POOLINGS

log = logging.getLogger("tfserve.scheduler")


class Scheduler:
    """Queue + worker thread over one Backend. Thread-safe `submit_*`; `start` / `stop`.

    `clock` is time.monotonic, or a test's clock: deadlines, waits and queue times are read
    from it. Without the thread, `run_once` drives the worker pass by pass (tests, with a
    fake backend that fails or holds where they choose).
    """

    def __init__(self, backend: Backend, config: SchedulerConfig | None = None,
                 metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.clock = clock
        self.config = (config or SchedulerConfig()).validate()
        self.metrics = metrics or Metrics()
        self.stats = SchedulerStats()
        self.max_new_tokens_limit = backend.max_target_positions - 1
        # the queues and what is taken from them; guarded by _cond, as the flags below it
        self.policy = BatchingPolicy(self.config, self._now, self.metrics)
        self._cond = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        # worker thread only from here on
        self._batch = DecodeBatch(backend)
        self._outcomes = Outcomes(self.stats, self.metrics, self._now,
                                  self.policy.record_success)
        self._encoder = EncoderRuns(backend, self.config, self._outcomes)
        # translate items taken and encoded while the idle worker waits for company, not yet
        # joined (TakeMode.AHEAD)
        self._ahead: list[Joining] = []
        # the requests that joined the batch since its last step: the next step decides
        # their first tokens (JobTimes.first_token)
        self._joined: list[Job] = []

    def _now(self) -> float:
        """The policy's and the outcomes' clock: `self.clock` read at each call, so that a
        test may swap it while the scheduler runs."""
        return self.clock()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tfserve-worker", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Refuse new requests (Unavailable); queued and running ones go on."""
        with self._cond:
            self._accepting = False

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the worker; requests still queued or decoding fail with Unavailable."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing decoding."""
        with self._cond:
            return not (self.policy.queued or len(self._batch) or self._ahead)

    # -- submitting -------------------------------------------------------------------------

    def submit_translate(self, sources: Sequence[Sequence[int]],
                         options: DecodingOptions | Sequence[DecodingOptions],
                         deadline: float | None = None,
                         on_event: Callable[[StreamEvent], None] | None = None) -> Job:
        """Queue token-id sources (each ending with eos) for translation with `options`: one
        for every source, or a sequence with one per source (inputs of one request may
        differ, e.g. in prefix_token_ids: a target prefix per text).

        Raises ValueError for options outside their limits, QueueFull, Unavailable.
        `on_event` (called on the worker thread) receives the tokens of every step for
        single-hypothesis searches and one final event per input.
        """
        per_source = [options] * len(sources) if isinstance(options, DecodingOptions) \
            else list(options)
        if len(per_source) != len(sources):
            raise ValueError(f"{len(per_source)} decoding options for {len(sources)} inputs")
        checked: dict[int, DecodingOptions] = {}  # by id: a shared object is checked once
        for given in per_source:
            if id(given) not in checked:
                checked[id(given)] = self._checked_options(given)
        per_source = [checked[id(given)] for given in per_source]
        job = Job("translate", per_source[0] if per_source else None, deadline, on_event,
                  submitted=self.clock())
        items = [WorkItem(job, index, list(source),
                          max(item_options.num_beams, item_options.num_return_sequences),
                          item_options)
                 for index, (source, item_options) in enumerate(zip(sources, per_source))]
        self._enqueue(job, items)
        return job

    def _checked_options(self, options: DecodingOptions) -> DecodingOptions:
        """Options validated against the model and the batch size (ValueError naming the
        field)."""
        options = options.validate(max_new_tokens_limit=self.max_new_tokens_limit,
                                   vocab_size=self.backend.vocab_size,
                                   eos_token_id=self.backend.eos_token_id)
        max_rows = max(options.num_beams, options.num_return_sequences)
        if max_rows > self.config.max_batch_size:
            field_name = "num_beams" if options.num_beams >= max_rows else "num_return_sequences"
            raise ValueError(f"{field_name} is {max_rows}, over the server's max batch size of "
                             f"{self.config.max_batch_size}")
        return options

    def submit_encode(self, sources: Sequence[Sequence[int]], pooling: str = "mean",
                      return_hidden_states: bool = False,
                      deadline: float | None = None) -> Job:
        """Queue token-id sources for the encoder; results are `Encoded`, in input order."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        job = Job("encode", None, deadline, pooling=pooling,
                  return_hidden_states=return_hidden_states, submitted=self.clock())
        items = [WorkItem(job, index, list(source)) for index, source in enumerate(sources)]
        self._enqueue(job, items)
        return job

    def translate(self, sources: Sequence[Sequence[int]], options: DecodingOptions,
                  timeout: float | None = None) -> list[list[Hypothesis]]:
        """Blocking convenience: submit and wait."""
        return self.submit_translate(sources, options).result(timeout)

    def _enqueue(self, job: Job, items: list[WorkItem]) -> None:
        if not items:
            raise ValueError("texts must not be empty")
        for item in items:
            if not item.source:
                raise ValueError(f"texts[{item.index}] is empty")
        job.results = [None] * len(items)
        job.remaining = job.unadmitted = len(items)
        job.input_tokens = sum(len(item.source) for item in items)
        with self._cond:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            self.policy.add(job, items)  # or QueueFull
            self._cond.notify_all()

    # -- the worker -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        self._shutdown()
                        return
                    if len(self._batch):
                        break  # decoding never waits: new items join between steps
                    if self.policy.queued or self._ahead:
                        wait = self._batching_wait()
                        if wait <= 0 or self._may_encode_ahead():
                            break  # start now, or encode the arrivals while waiting
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
            self.run_once()

    def run_once(self) -> None:
        """One pass of the worker loop, without waiting: drop the rows of finished requests,
        take what may start now, encode and join it, run one decoder step. The worker thread
        calls it; a test without the thread drives the scheduler step by step with it.

        Whatever fails in it fails the requests it was working on, never the worker, and
        every request it took ends with an answer or an error.
        """
        translate_items: list[WorkItem] = []
        encode_items: list[WorkItem] = []
        try:
            # rows of cancelled / expired requests leave first, so admission can reuse them
            self._drop_finished_rows()
            with self._cond:
                take = self.policy.take(self._running())
            translate_items, encode_items = take.translate, take.encode
            if translate_items or encode_items:
                taken = time.perf_counter()
                for item in translate_items + encode_items:
                    if item.job.times.taken is None:
                        item.job.times.taken = taken
            for item, reason in take.dropped:
                self._outcomes.unstarted(item, reason)
            self._iteration(translate_items, encode_items, take.mode)
        except Exception as exc:  # a bug or a failed cache copy: keep the worker alive
            log.exception("scheduler iteration failed")
            pending = {item.job for item in self._ahead_items()}
            self._ahead = []
            self._fail_batch("iteration", exc,
                             {item.job for item in translate_items + encode_items} | pending)

    # -- what the policy sees ---------------------------------------------------------------

    def _running(self) -> Running:
        """The worker's state as the policy reads it."""
        return Running([member.tag for member in self._batch.members], self._ahead_items())

    def _batching_wait(self) -> float:
        """Seconds the idle worker waits for more work before starting a batch (<= 0: now)."""
        return self.policy.batching_wait(self._running())

    def _may_encode_ahead(self) -> bool:
        """Whether the idle worker encodes the queue's head now instead of waiting."""
        return self.policy.may_encode_ahead(self._running())

    def _ahead_items(self) -> list[WorkItem]:
        """The translate items encoded ahead, waiting to join (whether their requests go on
        or not)."""
        return [item for group in self._ahead for item in group.tags]

    # -- one pass ---------------------------------------------------------------------------

    def _iteration(self, translate_items: list[WorkItem], encode_items: list[WorkItem],
                   mode: TakeMode = TakeMode.JOIN) -> None:
        if encode_items:
            self._run_encode(encode_items)
        if mode is TakeMode.AHEAD:
            self._ahead += self._encode_items(translate_items)
            return
        joining = bool(translate_items) or bool(self._ahead and mode is TakeMode.JOIN)
        if joining:
            self._admit(translate_items)
        if joining or encode_items:
            # the model runs just now took time: rows may have been cancelled or expired
            # since the loop's own check (without them, that check was a moment ago)
            self._drop_finished_rows()
        if len(self._batch):
            self._step()

    def _live(self, items: list[WorkItem]) -> list[WorkItem]:
        """The items whose requests go on (those of ended ones are skipped)."""
        now = self.clock()
        return [item for item in items if item.finished_reason(now) is None]

    def _run_encode(self, items: list[WorkItem]) -> None:
        for item, result in self._encoder.embed(self._live(items)):
            self._outcomes.item_done(item, result)

    def _admit(self, items: list[WorkItem]) -> None:
        """Encode new translate items and join them, and those encoded ahead, to the running
        decoder batch."""
        self._drop_finished_ahead()
        groups, self._ahead = self._ahead + self._encode_items(items), []
        # one join for every chunk: each join copies the whole running cache, so a wave cut
        # into 4 encoder batches joined one by one copied its cross K/V about 2.5 times
        # (opus-mt-base, 32 rows: 60-90 ms a wave)
        try:
            self._batch.join(groups)
        except Exception as exc:  # the batch may be half-joined: start over
            self._fail_batch("encode", exc, {item.job for group in groups
                                             for item in group.tags})
            return
        self._joined += [item.job for group in groups for item in group.tags]

    def _encode_items(self, items: list[WorkItem]) -> list[Joining]:
        """Run the encoder over translate items; returns what joins the decoder batch. A
        failed encoder batch fails only its own requests."""
        return self._encoder.translate(self._live(items))

    def _drop_finished_rows(self) -> None:
        """Remove the rows of cancelled, expired and failed requests before the next step (and
        those encoded ahead)."""
        if self._ahead:
            self._drop_finished_ahead()
        now = self.clock()
        reasons: dict[WorkItem, str] = {}
        for member in self._batch.members:
            reason = member.tag.finished_reason(now)
            if reason is not None:
                reasons[member.tag] = reason
        if not reasons:
            return
        removed_rows = {member.tag: member.search.rows for member in self._batch.members
                        if member.tag in reasons}
        removed = self._batch.remove(set(reasons))  # in member order, as removed_rows
        if not len(self._batch):
            # DecodeBatch.remove of every member leaves its last_tokens behind, which the next
            # join() would prepend to the newcomers' start tokens: start from a fresh batch
            self._batch = DecodeBatch(self.backend)
        for search, item in zip(removed, list(removed_rows), strict=True):
            assert search.options.max_new_tokens is not None
            skipped = max(search.options.max_new_tokens - search.generated, 0)
            self._outcomes.dropped(reasons[item], removed_rows[item], skipped)

    def _drop_finished_ahead(self) -> None:
        """Drop the cancelled, expired and failed items among those encoded ahead (worker
        thread), so that they neither join the batch nor keep its rows reserved."""
        now = self.clock()
        kept = []
        for group in self._ahead:
            reasons = [item.finished_reason(now) for item in group.tags]
            live = [row for row, reason in enumerate(reasons) if reason is None]
            for item, reason in zip(group.tags, reasons, strict=True):
                if reason is not None:
                    self._outcomes.unstarted(item, reason)
            if len(live) == len(reasons):
                kept.append(group)
            elif live:
                kept.append(self._encoder.select(group, live))
        self._ahead = kept

    def _step(self) -> None:
        batch = self._batch
        members = list(batch.members)
        rows = batch.rows - batch.retired_rows  # the running searches' rows
        started = time.perf_counter()
        try:
            finished = batch.step()
        except Exception as exc:
            if isinstance(exc, BatchRunError) and self._isolate_failed_run(members):
                return
            # searches that finished before the failure have their answers: deliver them;
            # the batch's run failed for the others
            for member in members:
                search = member.search
                if search.done and search.error is None:
                    self._outcomes.item_done(member.tag, search.results())
            self._fail_batch("step", exc, {member.tag.job for member in members})
            return
        ended = time.perf_counter()
        elapsed = ended - started
        if self._joined:  # this step decided the first tokens of the requests that joined
            for job in self._joined:
                if job.times.first_token is None:
                    job.times.first_token = ended
            self._joined = []
        self.policy.record_step(elapsed)
        self.stats.steps += 1
        self.stats.rows_stepped += rows
        self.metrics.decoder_steps.inc()
        self.metrics.batch_rows.observe(rows)
        self.metrics.step_seconds.observe(elapsed)
        done = {id(item): search for item, search in finished}
        for member in members:
            item = member.tag
            search = done.get(id(item))
            try:
                if search is not None and search.error is not None:
                    self._outcomes.search_failed(item, search.error)
                    continue
                if item.job.on_event is not None and not item.job.done:
                    streamed = [int(t) for t in member.search.streamed]
                    hypotheses = search.results() if search is not None else None
                    if streamed or hypotheses is not None:
                        self._outcomes.emit(item, StreamEvent(item.index, streamed, hypotheses))
                if search is not None:
                    self._outcomes.item_done(item, search.results())
            except Exception as exc:  # this request's own bookkeeping: it alone fails
                self._outcomes.search_failed(item, exc)

    def _isolate_failed_run(self, members: list[Any]) -> bool:
        """After a failed decoder run, run each member's rows alone: when some fail alone and
        others do not, only the failing ones leave the batch and fail their requests; the
        others step on at the next pass. False when no such split exists (every member fails
        alone, or none does: the failure belongs to the whole run)."""
        if len(members) < 2:
            return False
        culprits = []
        for member in members:
            error = self._batch.run_alone(member.tag)
            if error is not None:
                culprits.append((member.tag, error))
        if not culprits or len(culprits) == len(members):
            return False
        self._batch.remove({item for item, _ in culprits})
        for item, error in culprits:
            self._outcomes.model_failed("step", error, {item.job})
        return True

    def _fail_batch(self, stage: str, exc: BaseException, extra: set[Job] | None = None) -> None:
        """Fail every request decoding now (and `extra`), and start from an empty batch."""
        jobs = {member.tag.job for member in self._batch.members} | (extra or set())
        self._outcomes.model_failed(stage, exc, jobs)
        self._batch = DecodeBatch(self.backend)
        self._joined = []

    def _shutdown(self) -> None:
        """Under the lock, on stop: fail whatever is left."""
        error = Unavailable("the server is shutting down")
        for item in self.policy.drain():
            item.job._fail(error)
        for member in self._batch.members:
            member.tag.job._fail(error)
        for item in self._ahead_items():
            item.job._fail(error)
        self._ahead = []
        self._batch = DecodeBatch(self.backend)
