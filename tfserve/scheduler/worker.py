"""The request scheduler: dynamic batching of encoder work, continuous batching of decoding.

Requests are split into per-input work items. One worker thread owns the model (ONNX Runtime
is only ever called from it) and runs this loop:

    take queued items            (FIFO; rows reserved <= max_batch_size)
    -> encode them               (length-sorted batches under max_batch_size / max_batch_tokens)
    -> join the DecodeBatch      (batch.DecodeBatch.join)
    -> drop rows of cancelled, expired and failed requests (DecodeBatch.remove)
    -> one decoder step          (DecodeBatch.step) -> stream tokens, resolve finished requests
    -> repeat; sleep on a condition when there is nothing to do

(while an idle worker waits for a wave of returning requests, it encodes them as they come and
joins them together when the wait ends: `_gather_deadline`, `SchedulerConfig.encode_ahead`),
so a request that arrives while others are decoding joins at the next step instead of waiting
for the running batch to finish, and the rows a finished or cancelled request frees are reused
at once. Encode requests (sentence embeddings) go through the same worker, batched the same way.

A beam search or multi-sample search starts as one row and fans out after its first step, so
admission reserves its largest row count (max(num_beams, num_return_sequences)) up front: the
running batch never grows past max_batch_size.

Results are delivered through a `concurrent.futures.Future` per request (`Job.future`); the
gRPC server awaits it with `asyncio.wrap_future`, which hands the result to the event loop with
`call_soon_threadsafe`. Streaming callbacks run on the worker thread and must only hand off.
This module knows nothing about gRPC: errors are the exception classes below, which the server
maps to status codes in one place.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tfserve.batch import BatchRunError, DecodeBatch, Joining
from tfserve.generation import Backend, DecodingOptions, Hypothesis, make_search
from tfserve.inputs import POOLINGS, encoder_hidden_states, length_groups, pool
from tfserve.metrics import Metrics

log = logging.getLogger("tfserve.scheduler")


# -- errors (the server maps each to one gRPC status) ---------------------------------------


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


# -- configuration, results -----------------------------------------------------------------


@dataclass
class SchedulerConfig:
    """Batching limits. See docs/server.md for the matching server flags."""

    max_batch_size: int = 32  # rows in the running decoder batch; inputs per encoder run
    max_batch_tokens: int = 8192  # padded source tokens per encoder run
    max_wait_ms: float = 2.0  # how long arrivals wait for company (Scheduler._gather_deadline)
    max_queue: int = 256  # requests with inputs not yet taken up by the model
    # how many decoder steps arrivals may wait for the rows that just finished to come back
    # (closed-loop clients); 0: never wait for them
    wave_wait_steps: int = 4
    # while the idle worker waits for company, encode what has arrived (the wait then
    # overlaps encoder work); the rows join the decoder batch together when the wait ends.
    # Off by default: on 2 shared cores the encoder runs slowed the event loop receiving the
    # rest of the wave as much as they saved (docs/benchmarks.md, "Server settings compared")
    encode_ahead: bool = False

    def validate(self) -> SchedulerConfig:
        for name in ("max_batch_size", "max_batch_tokens", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        value = self.wave_wait_steps
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"wave_wait_steps must be an integer >= 0, got {value!r}")
        if not 0 <= self.max_wait_ms <= 10_000:  # a finite wait: inf would hold arrivals
            raise ValueError(f"max_wait_ms must be in [0, 10000], got {self.max_wait_ms!r}")
        return self


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
        self.generated_tokens = 0
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
class _Item:
    job: Job
    index: int
    source: list[int]
    max_rows: int = 1  # rows this input may occupy in the decoder batch

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


# -- the scheduler --------------------------------------------------------------------------


class Scheduler:
    """Queue + worker thread over one Backend. Thread-safe `submit_*`; `start` / `stop`.

    `test_hook(stage)`, when set, is called on the worker before every model run with stage
    "encode", "embed" or "step"; raising from it simulates a failed run, blocking in it holds
    the model (tests). `clock` is time.monotonic, or a test's clock: deadlines, waits and
    queue times are read from it.
    """

    def __init__(self, backend: Backend, config: SchedulerConfig | None = None,
                 metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.clock = clock
        self.config = (config or SchedulerConfig()).validate()
        self.metrics = metrics or Metrics()
        self.stats = SchedulerStats()
        self.test_hook: Callable[[str], None] | None = None
        self.max_new_tokens_limit = backend.max_target_positions - 1
        self._cond = threading.Condition()  # guards the queues and the flags below it
        self._translate_queue: deque[_Item] = deque()
        self._encode_queue: deque[_Item] = deque()
        self._queued_jobs = 0
        self._accepting = True
        self._stopping = False
        self._batch = DecodeBatch(backend)
        self._thread: threading.Thread | None = None
        # for the wait for company (_gather_deadline)
        self._step_seconds = 0.0  # running mean of recent decoder steps
        # (clock time, rows) of translate requests that succeeded, oldest first: their
        # clients' next requests may be on the way; admitted rows use them up, oldest first.
        # Worker thread only (no lock).
        self._freed: deque[tuple[float, int]] = deque(maxlen=1024)
        # translate items taken and encoded while the idle worker waits for company, not yet
        # joined (_encode_ahead). Worker thread only.
        self._ahead: list[Joining] = []

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
            return not (self._translate_queue or self._encode_queue or len(self._batch)
                        or self._ahead)

    # -- submitting -------------------------------------------------------------------------

    def submit_translate(self, sources: Sequence[Sequence[int]], options: DecodingOptions,
                         deadline: float | None = None,
                         on_event: Callable[[StreamEvent], None] | None = None) -> Job:
        """Queue token-id sources (each ending with eos) for translation with `options`.

        Raises ValueError for options outside their limits, QueueFull, Unavailable.
        `on_event` (called on the worker thread) receives the tokens of every step for
        single-hypothesis searches and one final event per input.
        """
        options = options.validate(max_new_tokens_limit=self.max_new_tokens_limit)
        max_rows = max(options.num_beams, options.num_return_sequences)
        if max_rows > self.config.max_batch_size:
            field_name = "num_beams" if options.num_beams >= max_rows else "num_return_sequences"
            raise ValueError(f"{field_name} is {max_rows}, over the server's max batch size of "
                             f"{self.config.max_batch_size}")
        job = Job("translate", options, deadline, on_event, submitted=self.clock())
        items = [_Item(job, index, list(source), max_rows) for index, source in enumerate(sources)]
        self._enqueue(job, items, self._translate_queue)
        return job

    def submit_encode(self, sources: Sequence[Sequence[int]], pooling: str = "mean",
                      return_hidden_states: bool = False,
                      deadline: float | None = None) -> Job:
        """Queue token-id sources for the encoder; results are `Encoded`, in input order."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        job = Job("encode", None, deadline, pooling=pooling,
                  return_hidden_states=return_hidden_states, submitted=self.clock())
        items = [_Item(job, index, list(source)) for index, source in enumerate(sources)]
        self._enqueue(job, items, self._encode_queue)
        return job

    def translate(self, sources: Sequence[Sequence[int]], options: DecodingOptions,
                  timeout: float | None = None) -> list[list[Hypothesis]]:
        """Blocking convenience: submit and wait."""
        return self.submit_translate(sources, options).result(timeout)

    def _enqueue(self, job: Job, items: list[_Item], queue: deque[_Item]) -> None:
        if not items:
            raise ValueError("texts must not be empty")
        for item in items:
            if not item.source:
                raise ValueError(f"texts[{item.index}] is empty")
        job.results = [None] * len(items)
        job.remaining = job.unadmitted = len(items)
        with self._cond:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if self._queued_jobs >= self.config.max_queue:
                raise QueueFull(f"the request queue is full ({self.config.max_queue} requests "
                                "waiting); retry later")
            self._queued_jobs += 1
            self.metrics.queue_depth.set(self._queued_jobs)
            queue.extend(items)
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
                    if self._translate_queue or self._encode_queue or self._ahead:
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
        translate_items: list[_Item] = []
        encode_items: list[_Item] = []
        try:
            # rows of cancelled / expired requests leave first, so admission can reuse them
            self._drop_finished_rows()
            with self._cond:
                translate_items, encode_items, mode = self._take()
            self._iteration(translate_items, encode_items, mode)
        except Exception as exc:  # a bug or a failed cache copy: keep the worker alive
            log.exception("scheduler iteration failed")
            pending = {item.job for item in self._ahead_items()}
            self._ahead = []
            self._fail_batch("iteration", exc,
                             {item.job for item in translate_items + encode_items} | pending)

    def _batching_wait(self) -> float:
        """Seconds the idle worker waits for more work before starting a batch (<= 0: now)."""
        if self._encode_queue:
            return 0.0  # an Encode request never waits for translation company
        deadline = self._gather_deadline(self.clock(), self._reserved_rows())
        return 0.0 if deadline is None else deadline - self.clock()

    def _reserved_rows(self) -> int:
        """Rows the running batch's members and the encoded items waiting to join it may
        occupy (each its largest row count)."""
        return (sum(member.tag.max_rows for member in self._batch.members)
                + sum(item.max_rows for item in self._ahead_items(live=True)))

    def _ahead_items(self, live: bool = False) -> list[_Item]:
        """The translate items encoded ahead, waiting to join (live: not cancelled, failed or
        expired; such rows reserve nothing while they wait to be dropped)."""
        now = self.clock()
        return [item for group in self._ahead for item in group.tags
                if not live or item.finished_reason(now) is None]

    def _oldest_waiting(self) -> float | None:
        """When the oldest translate item not yet decoding arrived (encoded ahead or queued)."""
        times = [item.job.submitted for item in self._ahead_items(live=True)]
        times += [self._translate_queue[0].job.submitted] if self._translate_queue else []
        return min(times) if times else None

    def _ahead_allowed(self) -> bool:
        """Whether arrivals that wait for company may be encoded ahead: configured, and the
        worker has no rows to decode."""
        return self.config.encode_ahead and not len(self._batch)

    def _may_encode_ahead(self) -> bool:
        """Whether the idle worker encodes the queue's head now instead of waiting (under the
        lock): it may encode ahead, is waiting for company, and the head fits."""
        queue = self._translate_queue
        if not (queue and self._ahead_allowed()):
            return False
        reserved = self._reserved_rows()
        return (reserved + queue[0].max_rows <= self.config.max_batch_size
                and self._gather_deadline(self.clock(), reserved) is not None)

    def _gather_deadline(self, now: float, reserved: int) -> float | None:
        """Until when queued translate requests wait for company before they are encoded and
        joined (None: take them now); reserved: `_reserved_rows()`. Worker thread, under the
        lock.

        Each join costs an encoder run per length group and a copy of the running cache, and
        rows that join a step apart also finish a step apart. Closed-loop clients (a client
        sends its next request when its answer arrives) whose requests end on the same step
        come back together, a round trip later; starting with the first few splits that wave
        into groups a step or more apart, and the split lasts: each group then pays its own
        encoder runs and joins, and steps run with rows missing. So when requests finished
        recently (`_freed`), arrivals wait until as many rows are queued as finished, for at
        most max(max_wait_ms, wave_wait_steps decoder steps) after the oldest arrival. The
        cost, where the clients do not come back (open-loop traffic): an arrival just after
        other requests finished waits up to those steps (wave_wait_steps=0 turns this off).
        Otherwise a request that finds the worker idle starts at once (a lone request never
        waits), and arrivals at a running batch wait up to max_wait_ms to fill its free rows
        together.
        """
        queue = self._translate_queue
        oldest = self._oldest_waiting()
        if oldest is None:
            return None
        max_wait = self.config.max_wait_ms / 1000.0
        bound = max(max_wait, self.config.wave_wait_steps * self._step_seconds)
        while self._freed and self._freed[0][0] < oldest - bound:
            self._freed.popleft()  # too long ago to be what is arriving now
        expected = sum(rows for _, rows in self._freed) if self.config.wave_wait_steps else 0
        decoding = bool(len(self._batch))
        free = self.config.max_batch_size - reserved
        queued = sum(item.max_rows for item in queue)
        if expected:
            target = min(expected, free)
        elif decoding:
            target, bound = free, max_wait
        else:
            return None
        return oldest + bound if queued < target and now < oldest + bound else None

    def _use_freed(self, rows: int) -> None:
        """Admitted rows use up the oldest expected arrivals."""
        while rows > 0 and self._freed:
            at, expected = self._freed.popleft()
            if expected > rows:
                self._freed.appendleft((at, expected - rows))
            rows -= expected

    def _take(self) -> tuple[list[_Item], list[_Item], str]:
        """Under the lock: drop dead queued items, take what fits into the next iteration.

        Returns the translate items, the encode items, and what becomes of the translate
        items: "join" the decoder batch now (with any encoded ahead), or, while the wait for
        company goes on, "ahead" (encode them and hold them) or "hold" (none taken; the
        ones encoded ahead keep waiting too).
        """
        if not (self._translate_queue or self._encode_queue or self._ahead):
            return [], [], "join"  # mid-decoding with nothing queued: most iterations
        now = self.clock()
        for queue in (self._translate_queue, self._encode_queue):
            if any(item.job.done or item.job.expired(now) for item in queue):
                kept = []
                for item in queue:
                    reason = item.finished_reason(now)
                    if reason is None:
                        kept.append(item)
                    else:
                        self._count_unstarted(item, reason)
                        self._admitted(item, now)
                queue.clear()
                queue.extend(kept)
        encode_items = []
        while self._encode_queue and len(encode_items) < self.config.max_batch_size:
            encode_items.append(self._encode_queue.popleft())
        translate_items = []
        reserved = self._reserved_rows()
        gathering = self._gather_deadline(now, reserved) is not None
        ahead = gathering and self._ahead_allowed()
        # FIFO without overtaking: a wide beam search at the head waits for rows to free up
        # rather than being starved by a stream of greedy requests behind it
        while ((ahead or not gathering) and self._translate_queue
               and reserved + self._translate_queue[0].max_rows <= self.config.max_batch_size):
            item = self._translate_queue.popleft()
            reserved += item.max_rows
            translate_items.append(item)
        self._use_freed(sum(item.max_rows for item in translate_items))
        for item in encode_items + translate_items:
            self._admitted(item, now)
        mode = "join" if not gathering else "ahead" if translate_items else "hold"
        return translate_items, encode_items, mode

    def _admitted(self, item: _Item, now: float) -> None:
        """Bookkeeping when an item leaves the queue (under the lock)."""
        job = item.job
        job.queue_seconds = max(job.queue_seconds, now - job.submitted)
        job.unadmitted -= 1
        if job.unadmitted == 0:
            self._queued_jobs -= 1
            self.metrics.queue_depth.set(self._queued_jobs)
        if not job.done:
            self.metrics.queue_seconds.observe(now - job.submitted)

    def _iteration(self, translate_items: list[_Item], encode_items: list[_Item],
                   mode: str = "join") -> None:
        if encode_items:
            self._run_encode(encode_items)
        if mode == "ahead":
            self._ahead += self._encode_items(translate_items)
            return
        joining = bool(translate_items) or bool(self._ahead and mode == "join")
        if joining:
            self._admit(translate_items)
        if joining or encode_items:
            # the model runs just now took time: rows may have been cancelled or expired
            # since the loop's own check (without them, that check was a moment ago)
            self._drop_finished_rows()
        if len(self._batch):
            self._step()

    def _chunks(self, items: list[_Item]) -> list[list[_Item]]:
        """Length-sorted encoder batches within max_batch_size rows and max_batch_tokens,
        cut where padding would cost more than another encoder call (length_groups)."""
        groups = length_groups([len(item.source) for item in items],
                               self.config.max_batch_size, self.config.max_batch_tokens)
        return [[items[i] for i in group] for group in groups]

    def _pad(self, items: list[_Item]) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded input_ids and attention_mask, int64 [B,S]."""
        width = max(len(item.source) for item in items)
        input_ids = np.full((len(items), width), self.backend.pad_token_id, np.int64)
        attention_mask = np.zeros((len(items), width), np.int64)
        for row, item in enumerate(items):
            input_ids[row, : len(item.source)] = item.source
            attention_mask[row, : len(item.source)] = 1
        return input_ids, attention_mask

    def _model_call(self, stage: str) -> None:
        if self.test_hook is not None:
            self.test_hook(stage)

    def _run_encode(self, items: list[_Item]) -> None:
        now = self.clock()
        live = [item for item in items if item.finished_reason(now) is None]
        for chunk in self._chunks(live):
            self._embed_chunk(chunk)

    def _embed_chunk(self, chunk: list[_Item]) -> None:
        """One encoder run for Encode requests; a failed run is tried again input by input,
        as in _encode_chunk."""
        input_ids, attention_mask = self._pad(chunk)
        try:
            self._model_call("embed")
            hidden = encoder_hidden_states(self.backend, input_ids, attention_mask)
        except Exception as exc:
            if len(chunk) > 1:
                for item in chunk:
                    self._embed_chunk([item])
            else:
                self._model_failed("embed", exc, {chunk[0].job})
            return
        self.stats.encoder_runs += 1
        self.metrics.encoder_batch_rows.observe(len(chunk))
        for row, item in enumerate(chunk):
            length = len(item.source)
            job = item.job
            # pool one row at a time: rows of a chunk may come from requests with
            # different pooling
            embedding = pool(hidden[row : row + 1], attention_mask[row : row + 1],
                             job.pooling)[0]
            states = hidden[row, :length].copy() if job.return_hidden_states else None
            self._item_done(item, Encoded(item.source, embedding, states))

    def _admit(self, items: list[_Item]) -> None:
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

    def _encode_items(self, items: list[_Item]) -> list[Joining]:
        """Run the encoder over translate items (length-sorted chunks); returns what joins
        the decoder batch. A failed chunk fails only its own requests."""
        now = self.clock()
        live = [item for item in items if item.finished_reason(now) is None]
        return [group for chunk in self._chunks(live) for group in self._encode_chunk(chunk)]

    def _encode_chunk(self, chunk: list[_Item]) -> list[Joining]:
        """One encoder run; when it fails, each input is tried alone, so that an input the
        model cannot take fails its own request and not the others of its chunk."""
        backend = self.backend
        input_ids, attention_mask = self._pad(chunk)
        try:
            self._model_call("encode")
            _, cross = backend.encode(input_ids, attention_mask)
        except Exception as exc:
            if len(chunk) > 1:
                return [group for item in chunk for group in self._encode_chunk([item])]
            self._model_failed("encode", exc, {chunk[0].job})
            return []
        self.stats.encoder_runs += 1
        self.metrics.encoder_batch_rows.observe(len(chunk))
        searches = []
        for item in chunk:
            assert item.job.options is not None
            searches.append(make_search(item.job.options, backend.eos_token_id,
                                        backend.decoder_start_token_id))
        return [Joining(searches, chunk, cross, attention_mask)]

    def _drop_finished_rows(self) -> None:
        """Remove the rows of cancelled, expired and failed requests before the next step (and
        those encoded ahead)."""
        if self._ahead:
            self._drop_finished_ahead()
        now = self.clock()
        reasons: dict[_Item, str] = {}
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
            self._count_dropped(reasons[item], removed_rows[item], skipped)

    def _count_unstarted(self, item: _Item, reason: str) -> None:
        """An item dropped before it decoded (queued or encoded ahead): every step it would
        have taken is saved, and it held no decoder rows."""
        options = item.job.options
        self._count_dropped(reason, 0, options.max_new_tokens or 0 if options is not None else 0)

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
                    self._count_unstarted(item, reason)
            if len(live) == len(reasons):
                kept.append(group)
            elif live:
                index = np.asarray(live, np.int64)
                kept.append(Joining([group.searches[row] for row in live],
                                    [group.tags[row] for row in live],
                                    self.backend.take_rows(group.cross, index),
                                    group.encoder_attention_mask[index]))
        self._ahead = kept

    def _count_dropped(self, reason: str, rows: int, skipped_steps: int) -> None:
        stats = self.stats
        stats.freed_rows[reason] = stats.freed_rows.get(reason, 0) + rows
        stats.skipped_steps[reason] = stats.skipped_steps.get(reason, 0) + skipped_steps
        if rows:
            self.metrics.freed_rows.labels(reason).inc(rows)
        if skipped_steps:
            self.metrics.skipped_steps.labels(reason).inc(skipped_steps)

    def _step(self) -> None:
        batch = self._batch
        members = list(batch.members)
        rows = batch.rows - batch.retired_rows  # the running searches' rows
        started = time.perf_counter()
        try:
            self._model_call("step")
            finished = batch.step()
        except BatchRunError as exc:
            if not self._isolate_failed_run(members, exc):
                self._fail_batch("step", exc, {member.tag.job for member in members})
            return
        except Exception as exc:
            # searches that finished before the failure have their answers: deliver them;
            # the batch's run failed for the others
            for member in members:
                search = member.search
                if search.done and search.error is None:
                    self._item_done(member.tag, search.results())
            self._fail_batch("step", exc, {member.tag.job for member in members})
            return
        elapsed = time.perf_counter() - started
        # a short memory: step times change with the batch's rows and cache length
        self._step_seconds = elapsed if not self._step_seconds else (
            0.8 * self._step_seconds + 0.2 * elapsed)
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
                    self._search_failed(item, search.error)
                    continue
                if item.job.on_event is not None and not item.job.done:
                    streamed = [int(t) for t in member.search.streamed]
                    hypotheses = search.results() if search is not None else None
                    if streamed or hypotheses is not None:
                        self._emit(item, StreamEvent(item.index, streamed, hypotheses))
                if search is not None:
                    self._item_done(item, search.results())
            except Exception as exc:  # this request's own bookkeeping: it alone fails
                self._search_failed(item, exc)

    def _isolate_failed_run(self, members: list[Any], exc: BatchRunError) -> bool:
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
            log.error("model run failed (step) for one request: %s", error)
            self.stats.model_errors += 1
            self.metrics.model_errors.labels("step").inc()
            item.job._fail(ModelError(f"model run failed (step): {error}"))
        return True

    def _search_failed(self, item: _Item, exc: BaseException) -> None:
        """One search failed on its own (not the batch's run): only its request fails."""
        log.error("search failed for one request: %s", exc, exc_info=exc)
        self.stats.model_errors += 1
        self.metrics.model_errors.labels("search").inc()
        item.job._fail(ModelError(f"decoding failed: {type(exc).__name__}: {exc}"))

    def _emit(self, item: _Item, event: StreamEvent) -> None:
        assert item.job.on_event is not None
        try:
            item.job.on_event(event)
        except Exception:  # a broken consumer must not take the worker down
            log.exception("stream callback failed")
            item.job.cancel()

    def _item_done(self, item: _Item, result: Any) -> None:
        job = item.job
        if job.done:
            return
        job.results[item.index] = result
        if isinstance(result, list):
            job.generated_tokens += sum(len(h.token_ids) for h in result)
            self.metrics.generated_tokens.inc(sum(len(h.token_ids) for h in result))
        job.remaining -= 1
        if job.remaining == 0:
            job._resolve()
            if job.kind == "translate":
                # the client may send its next request now: expect its rows back (every
                # input of a job reserves the same rows)
                self._freed.append((self.clock(), len(job.results) * item.max_rows))

    def _model_failed(self, stage: str, exc: BaseException, jobs: set[Job]) -> None:
        log.error("model run failed (%s) for %d request(s): %s", stage, len(jobs), exc,
                  exc_info=exc)
        self.stats.model_errors += 1
        self.metrics.model_errors.labels(stage).inc()
        for job in jobs:
            job._fail(ModelError(f"model run failed ({stage}): {exc}"))

    def _fail_batch(self, stage: str, exc: BaseException, extra: set[Job] | None = None) -> None:
        """Fail every request decoding now (and `extra`), and start from an empty batch."""
        jobs = {member.tag.job for member in self._batch.members} | (extra or set())
        self._model_failed(stage, exc, jobs)
        self._batch = DecodeBatch(self.backend)

    def _shutdown(self) -> None:
        """Under the lock, on stop: fail whatever is left."""
        error = Unavailable("the server is shutting down")
        for queue in (self._translate_queue, self._encode_queue):
            for item in queue:
                item.job._fail(error)
            queue.clear()
        for member in self._batch.members:
            member.tag.job._fail(error)
        for item in self._ahead_items():
            item.job._fail(error)
        self._ahead = []
        self._batch = DecodeBatch(self.backend)
        self._queued_jobs = 0
        self.metrics.queue_depth.set(0)
