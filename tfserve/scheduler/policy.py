"""The admission and batching policy: which queued inputs the worker takes up now, and how long
arrivals wait for company.

`BatchingPolicy` owns the queues, the count of queued requests, the memory of the rows that
requests which just succeeded freed, and a running mean of decoder step times. It has no thread
and no lock: the worker (`Scheduler`) calls it under its condition and tells it what it holds
(`Running`) at each call; time is read from the injected clock, so tests drive it with a fake
one.

Admission is FIFO without overtaking, and reserves each input's largest row count
(max(num_beams, num_return_sequences)): a beam search fans out after its first step, and the
running batch must never grow past max_batch_size.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tfserve.scheduler.jobs import Job, QueueFull, WorkItem
from tfserve.scheduler.scheduler_config import SchedulerConfig
from tfserve.telemetry.metrics import Metrics


@dataclass(frozen=True)
class Running:
    """What the worker holds, as the policy sees it."""

    decoding: Sequence[WorkItem] = ()  # the items of the decoder batch's running searches
    # translate items encoded ahead, waiting to join the decoder batch; those of requests
    # that ended meanwhile are among them until the worker drops them
    ahead: Sequence[WorkItem] = ()


class TakeMode(enum.Enum):
    """What becomes of the translate items one pass takes (`Take.mode`)."""

    JOIN = "join"  # they join the decoder batch now, with any encoded ahead
    # while the wait for company goes on: encode them and hold them ...
    AHEAD = "ahead"
    HOLD = "hold"  # ... or none is taken, and those encoded ahead keep waiting too


class Take(NamedTuple):
    """What one pass of the worker takes from the queues (`BatchingPolicy.take`)."""

    translate: list[WorkItem]
    encode: list[WorkItem]
    mode: TakeMode
    # queued items of requests that ended before the model took them up, and why: they
    # leave the queue without decoding
    dropped: list[tuple[WorkItem, str]]


class BatchingPolicy:
    """The queues and what the worker takes from them. Not thread-safe: the queues are
    shared with the threads that submit requests, so the scheduler calls `add`, `drain` and
    every decision under its lock; `record_step` and `record_success` come from the worker
    thread alone, which is also the only one that decides."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.translate_queue: deque[WorkItem] = deque()
        self.encode_queue: deque[WorkItem] = deque()
        self.queued_jobs = 0  # requests with inputs not yet taken up (max_queue bounds it)
        self.step_seconds = 0.0  # running mean of recent decoder steps
        # (clock time, rows) of translate requests that succeeded, oldest first: their
        # clients' next requests may be on the way; admitted rows use them up, oldest first
        self.freed: deque[tuple[float, int]] = deque(maxlen=1024)

    @property
    def queued(self) -> bool:
        """Whether inputs wait in a queue."""
        return bool(self.translate_queue or self.encode_queue)

    def add(self, job: Job, items: Sequence[WorkItem]) -> None:
        """Queue a request's items (translate or encode by its kind); QueueFull when
        max_queue requests are waiting already."""
        if self.queued_jobs >= self.config.max_queue:
            raise QueueFull(f"the request queue is full ({self.config.max_queue} requests "
                            "waiting); retry later")
        self.queued_jobs += 1
        self.metrics.queue_depth.set(self.queued_jobs)
        queue = self.translate_queue if job.kind == "translate" else self.encode_queue
        queue.extend(items)

    def drain(self) -> list[WorkItem]:
        """Empty the queues (on stop); the items they held, to be failed."""
        items = [*self.translate_queue, *self.encode_queue]
        self.translate_queue.clear()
        self.encode_queue.clear()
        self.queued_jobs = 0
        self.metrics.queue_depth.set(0)
        return items

    # -- what the worker reports ------------------------------------------------------------

    def record_step(self, seconds: float) -> None:
        """A decoder step took `seconds`."""
        # a short memory: step times change with the batch's rows and cache length
        self.step_seconds = seconds if not self.step_seconds else (
            0.8 * self.step_seconds + 0.2 * seconds)

    def record_success(self, now: float, rows: int) -> None:
        """A translate request that reserved `rows` succeeded at `now`: its client may send
        its next request now, so expect its rows back."""
        self.freed.append((now, rows))

    # -- the wait for company ---------------------------------------------------------------

    def batching_wait(self, running: Running) -> float:
        """Seconds the idle worker waits for more work before starting a batch (<= 0: now)."""
        if self.encode_queue:
            return 0.0  # an Encode request never waits for translation company
        deadline = self.gather_deadline(self.clock(), self.reserved_rows(running), running)
        return 0.0 if deadline is None else deadline - self.clock()

    def reserved_rows(self, running: Running) -> int:
        """Rows the running batch's members and the encoded items waiting to join it may
        occupy (each its largest row count)."""
        return (sum(item.max_rows for item in running.decoding)
                + sum(item.max_rows for item in self._live_ahead(running)))

    def may_encode_ahead(self, running: Running) -> bool:
        """Whether the idle worker encodes the queue's head now instead of waiting: it may
        encode ahead, is waiting for company, and the head fits."""
        queue = self.translate_queue
        if not (queue and self._ahead_allowed(running)):
            return False
        reserved = self.reserved_rows(running)
        return (reserved + queue[0].max_rows <= self.config.max_batch_size
                and self.gather_deadline(self.clock(), reserved, running) is not None)

    def gather_deadline(self, now: float, reserved: int, running: Running) -> float | None:
        """Until when queued translate requests wait for company before they are encoded and
        joined (None: take them now); reserved: `reserved_rows(running)`.

        Each join costs an encoder run per length group and a copy of the running cache, and
        rows that join a step apart also finish a step apart. Closed-loop clients (a client
        sends its next request when its answer arrives) whose requests end on the same step
        come back together, a round trip later; starting with the first few splits that wave
        into groups a step or more apart, and the split lasts: each group then pays its own
        encoder runs and joins, and steps run with rows missing. So when requests finished
        recently (`freed`), arrivals wait until as many rows are queued as finished, for at
        most max(max_wait_ms, wave_wait_steps decoder steps) after the oldest arrival. The
        cost, where the clients do not come back (open-loop traffic): an arrival just after
        other requests finished waits up to those steps (wave_wait_steps=0 turns this off).
        Otherwise a request that finds the worker idle starts at once (a lone request never
        waits), and arrivals at a running batch wait up to max_wait_ms to fill its free rows
        together.
        """
        oldest = self._oldest_waiting(running)
        if oldest is None:
            return None
        max_wait = self.config.max_wait_ms / 1000.0
        bound = max(max_wait, self.config.wave_wait_steps * self.step_seconds)
        while self.freed and self.freed[0][0] < oldest - bound:
            self.freed.popleft()  # too long ago to be what is arriving now
        expected = sum(rows for _, rows in self.freed) if self.config.wave_wait_steps else 0
        free = self.config.max_batch_size - reserved
        queued = sum(item.max_rows for item in self.translate_queue)
        if expected:
            target = min(expected, free)
        elif running.decoding:
            target, bound = free, max_wait
        else:
            return None
        return oldest + bound if queued < target and now < oldest + bound else None

    # -- admission --------------------------------------------------------------------------

    def take(self, running: Running) -> Take:
        """Drop the queued items of requests that ended, and take what fits into the worker's
        next pass (see `Take`)."""
        if not (self.translate_queue or self.encode_queue or running.ahead):
            return Take([], [], TakeMode.JOIN, [])  # mid-decoding, nothing queued: most passes
        now = self.clock()
        dropped = []
        for queue in (self.translate_queue, self.encode_queue):
            if any(item.job.done or item.job.expired(now) for item in queue):
                kept = []
                for item in queue:
                    reason = item.finished_reason(now)
                    if reason is None:
                        kept.append(item)
                    else:
                        dropped.append((item, reason))
                        self._admitted(item, now)
                queue.clear()
                queue.extend(kept)
        encode_items = []
        while self.encode_queue and len(encode_items) < self.config.max_batch_size:
            encode_items.append(self.encode_queue.popleft())
        translate_items = []
        reserved = self.reserved_rows(running)
        gathering = self.gather_deadline(now, reserved, running) is not None
        ahead = gathering and self._ahead_allowed(running)
        # FIFO without overtaking: a wide beam search at the head waits for rows to free up
        # rather than being starved by a stream of greedy requests behind it
        while ((ahead or not gathering) and self.translate_queue
               and reserved + self.translate_queue[0].max_rows <= self.config.max_batch_size):
            item = self.translate_queue.popleft()
            reserved += item.max_rows
            translate_items.append(item)
        self._use_freed(sum(item.max_rows for item in translate_items))
        for item in encode_items + translate_items:
            self._admitted(item, now)
        mode = (TakeMode.JOIN if not gathering else TakeMode.AHEAD if translate_items
                else TakeMode.HOLD)
        return Take(translate_items, encode_items, mode, dropped)

    def _live_ahead(self, running: Running) -> list[WorkItem]:
        """The items encoded ahead whose requests go on (those of cancelled, failed or expired
        ones reserve nothing while they wait to be dropped)."""
        now = self.clock()
        return [item for item in running.ahead if item.finished_reason(now) is None]

    def _oldest_waiting(self, running: Running) -> float | None:
        """When the oldest translate item not yet decoding arrived (encoded ahead or queued)."""
        times = [item.job.submitted for item in self._live_ahead(running)]
        times += [self.translate_queue[0].job.submitted] if self.translate_queue else []
        return min(times) if times else None

    def _ahead_allowed(self, running: Running) -> bool:
        """Whether arrivals that wait for company may be encoded ahead: configured, and the
        worker has no rows to decode."""
        return self.config.encode_ahead and not running.decoding

    def _use_freed(self, rows: int) -> None:
        """Admitted rows use up the oldest expected arrivals."""
        while rows > 0 and self.freed:
            at, expected = self.freed.popleft()
            if expected > rows:
                self.freed.appendleft((at, expected - rows))
            rows -= expected

    def _admitted(self, item: WorkItem, now: float) -> None:
        """Bookkeeping when an item leaves the queue."""
        job = item.job
        job.queue_seconds = max(job.queue_seconds, now - job.submitted)
        job.unadmitted -= 1
        if job.unadmitted == 0:
            self.queued_jobs -= 1
            self.metrics.queue_depth.set(self.queued_jobs)
        if not job.done:
            self.metrics.queue_seconds.observe(now - job.submitted)
