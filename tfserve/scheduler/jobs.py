"""What the scheduler works on and hands back: requests (`Job`), their per-input work items,
results, the errors a request can end with (the server maps each to one gRPC status), and
`Outcomes`, which ends requests and counts how they ended."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tfserve.generation import DecodingOptions, Hypothesis
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.scheduler")

# -- errors ---------------------------------------------------------------------------------


class SchedulerError(Exception):
    """Base of the errors a request can end with."""


class QueueFull(SchedulerError):
    """Too many requests are waiting (RESOURCE_EXHAUSTED)."""


class Unavailable(SchedulerError):
    """The scheduler is shutting down (UNAVAILABLE)."""


class DeadlineExceeded(SchedulerError):
    """The request's deadline passed while it was queued or decoding (DEADLINE_EXCEEDED)."""


class Cancelled(SchedulerError):
    """The caller cancelled the request (CANCELLED)."""


class ModelError(SchedulerError):
    """A model run failed for the batch this request was in (INTERNAL)."""


# -- results and counters -------------------------------------------------------------------


@dataclass
class StreamEvent:
    """Tokens decided for input `index` by the last step; `hypotheses` set when it finished."""

    index: int
    token_ids: list[int]
    hypotheses: list[Hypothesis] | None = None

    @property
    def done(self) -> bool:
        return self.hypotheses is not None


@dataclass
class Encoded:
    """Encode result of one input: pooled embedding [D], hidden states [len,D] on request."""

    token_ids: list[int]
    embedding: np.ndarray
    hidden_states: np.ndarray | None


@dataclass
class SchedulerStats:
    """Plain counters of the worker, readable without Prometheus (tests, logs)."""

    steps: int = 0
    encoder_runs: int = 0
    rows_stepped: int = 0
    model_errors: int = 0
    freed_rows: dict[str, int] = field(default_factory=dict)  # by reason
    skipped_steps: dict[str, int] = field(default_factory=dict)  # by reason


# -- jobs and items -------------------------------------------------------------------------


@dataclass
class JobTimes:
    """Moments of a request's life, time.perf_counter() seconds (None until they happen):
    what the time-to-first-token metric and the call's trace read once it has ended.

    Each is the first time it happens (a request whose inputs are taken in several passes
    has its first input's), so they come in the order of the fields. The worker stamps them
    once per request, never per step: they cost nothing measurable whether or not anyone
    reads them.
    """

    queued: float  # submitted to the scheduler
    taken: float | None = None  # its first input left the queue
    encoded: float | None = None  # its first encoder run ended
    first_token: float | None = None  # the decoder step that decided its first token ended
    first_event: float | None = None  # its first tokens went to the stream callback
    done: float | None = None  # its last result was in (not stamped when it failed)


_job_ids = itertools.count()


class Job:
    """One request: its inputs' work items, their results, and how it ended.

    `future` resolves to a list with one entry per input, in input order: a list of
    Hypothesis (translate) or an Encoded (encode); or fails with a SchedulerError.
    """

    def __init__(self, kind: str, options: DecodingOptions | None, deadline: float | None,
                 on_event: Callable[[StreamEvent], None] | None = None,
                 pooling: str = "mean", return_hidden_states: bool = False,
                 submitted: float | None = None) -> None:
        self.id = next(_job_ids)
        self.kind = kind
        self.options = options
        self.deadline = deadline  # the scheduler's clock (time.monotonic()) seconds, or None
        self.on_event = on_event
        self.pooling = pooling
        self.return_hidden_states = return_hidden_states
        self.future: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self.submitted = time.monotonic() if submitted is None else submitted
        self.queue_seconds = 0.0  # longest wait of one of its inputs before the model
        self.input_tokens = 0  # source tokens of its inputs
        self.generated_tokens = 0
        self.times = JobTimes(time.perf_counter())
        self.cancel_reason: str | None = None
        self.results: list[Any] = []
        self.remaining = 0  # inputs without a result yet
        self.unadmitted = 0  # inputs still in the queue

    @property
    def done(self) -> bool:
        return self.future.done()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def cancel(self, reason: str = "cancelled") -> None:
        """Give up on the request (client gone, deadline): its rows leave before the next step.

        Safe from any thread; the worker notices before its next step.
        """
        if self.done:
            return
        self.cancel_reason = reason
        error = DeadlineExceeded("deadline exceeded") if reason == "deadline" else Cancelled(
            "request cancelled")
        self._fail(error)

    def result(self, timeout: float | None = None) -> list[Any]:
        return self.future.result(timeout)

    def _resolve(self) -> None:
        try:
            self.future.set_result(self.results)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            pass

    def _fail(self, error: BaseException) -> None:
        try:
            self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:  # already resolved, failed or cancelled
            pass


@dataclass(eq=False)  # identity hashing: items are DecodeBatch tags
class WorkItem:
    """One input of a job: what the queues hold, the encoder batches and the decoder batch
    tags."""

    job: Job
    index: int
    source: list[int]
    max_rows: int = 1  # rows this input may occupy in the decoder batch
    # how to decode this input (translate); None: the job's options
    options: DecodingOptions | None = None

    @property
    def decoding_options(self) -> DecodingOptions | None:
        return self.options if self.options is not None else self.job.options

    def finished_reason(self, now: float) -> str | None:
        """Why this item should stop now (None: keep going); fails an expired job."""
        job = self.job
        if not job.done and job.expired(now):
            job.cancel("deadline")
        if not job.done:
            return None
        if job.future.cancelled():
            return "cancelled"
        return job.cancel_reason or "failed"


# -- how requests end -----------------------------------------------------------------------


class Outcomes:
    """Ends requests (results, errors) and counts how they ended, in `stats` and `metrics`.
    Worker thread only.

    `on_success(now, rows)` hears of every translate request that succeeded, with the rows
    it reserved: its client may send its next request now (the batching policy expects the
    rows back).
    """

    def __init__(self, stats: SchedulerStats, metrics: Metrics, clock: Callable[[], float],
                 on_success: Callable[[float, int], None]) -> None:
        self.stats = stats
        self.metrics = metrics
        self.clock = clock
        self.on_success = on_success

    def item_done(self, item: WorkItem, result: Any) -> None:
        """One input's result; the request resolves with its last."""
        job = item.job
        if job.done:
            return
        job.results[item.index] = result
        if isinstance(result, list):
            job.generated_tokens += sum(len(h.token_ids) for h in result)
            self.metrics.generated_tokens.inc(sum(len(h.token_ids) for h in result))
        job.remaining -= 1
        if job.remaining == 0:
            job.times.done = time.perf_counter()  # before the future: its waiter reads it
            job._resolve()
            if job.kind == "translate":
                # every input of a job reserves the same rows
                self.on_success(self.clock(), len(job.results) * item.max_rows)

    def emit(self, item: WorkItem, event: StreamEvent) -> None:
        """Hand streamed tokens to the request's callback; a callback that raises cancels
        its request."""
        assert item.job.on_event is not None
        times = item.job.times
        if times.first_event is None:
            times.first_event = time.perf_counter()
        try:
            item.job.on_event(event)
        except Exception:  # a broken consumer must not take the worker down
            log.exception("stream callback failed")
            item.job.cancel()

    def search_failed(self, item: WorkItem, exc: BaseException) -> None:
        """One search failed on its own (not the batch's run): only its request fails."""
        log.error("search failed for one request: %s", exc, exc_info=exc)
        self.stats.model_errors += 1
        self.metrics.model_errors.labels("search").inc()
        item.job._fail(ModelError(f"decoding failed: {type(exc).__name__}: {exc}"))

    def model_failed(self, stage: str, exc: BaseException, jobs: set[Job]) -> None:
        """A model run failed for these requests: each fails with ModelError."""
        log.error("model run failed (%s) for %d request(s): %s", stage, len(jobs), exc,
                  exc_info=exc)
        self.stats.model_errors += 1
        self.metrics.model_errors.labels(stage).inc()
        for job in jobs:
            job._fail(ModelError(f"model run failed ({stage}): {exc}"))

    def encoder_ran(self, items: list[WorkItem]) -> None:
        """An encoder run for these items succeeded."""
        self.stats.encoder_runs += 1
        self.metrics.encoder_batch_rows.observe(len(items))
        now = time.perf_counter()
        for item in items:
            if item.job.times.encoded is None:
                item.job.times.encoded = now

    def dropped(self, reason: str, rows: int, skipped_steps: int) -> None:
        """Rows of a request that ended (reason) left the decoder batch, saving steps."""
        stats = self.stats
        stats.freed_rows[reason] = stats.freed_rows.get(reason, 0) + rows
        stats.skipped_steps[reason] = stats.skipped_steps.get(reason, 0) + skipped_steps
        if rows:
            self.metrics.freed_rows.labels(reason).inc(rows)
        if skipped_steps:
            self.metrics.skipped_steps.labels(reason).inc(skipped_steps)

    def unstarted(self, item: WorkItem, reason: str) -> None:
        """An item dropped before it decoded (queued or encoded ahead): every step it would
        have taken is saved, and it held no decoder rows."""
        options = item.decoding_options
        self.dropped(reason, 0, options.max_new_tokens or 0 if options is not None else 0)
