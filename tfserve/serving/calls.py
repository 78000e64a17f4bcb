"""Per-call bookkeeping, whatever the transport.

`Calls` is the server's side: how many calls are in flight (the drain waits for none), whether
new ones are still taken, the per-(rpc, status) metrics (per model too, in a model
repository), the tracing (None: off). `Call` is one of them: its request id, its deadline,
the model it uses (counted in that model's requests in flight until the call ends), the job
it waits on, its span when tracing is on, and at its end one metrics update (time to first
token, input tokens), one access-log record and the span's end. The front end supplies what
only it knows (the peer, the id sent in metadata or a header, the time left before the
client's deadline, the metadata or headers that carry the trace context) and answers the
status `Call.failed` returns in its own way.

Everything here runs on the event loop's thread; job results arrive from the scheduler's
worker thread through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tfserve.scheduler import Cancelled, Job, ModelError
from tfserve.serving.process_tuning import trim_freed_memory
from tfserve.serving.requests import check_request_id
from tfserve.serving.status import (
    Draining,
    InvalidArgument,
    ModelLoadFailed,
    ResponseTooLarge,
    Status,
    status_for,
)
from tfserve.serving.tracing import (  # opentelemetry only when on
    SERVICE,
    CallSpan,
    Tracing,
    grpc_span_error,
)
from tfserve.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from tfserve.serving.loaded import LoadedModel

REQUEST_ID_KEY = "x-request-id"  # the metadata key (or HTTP header) that carries the id
# how a call that its client ended shows up: the handler's task is cancelled, or the
# generator behind a stream is closed
CALL_ENDED = (asyncio.CancelledError, GeneratorExit)

log = logging.getLogger("tfserve.server")
access_log = logging.getLogger("tfserve.access")

# a request message at least this large is a large request: once the large requests in
# flight have all ended, the memory glibc kept free is handed back (FreedMemory). Far above
# what translation requests weigh (a 256-text request of 40-character texts: ~11 KB)
LARGE_REQUEST_BYTES = 1 << 20


class FreedMemory:
    """Hands the memory glibc keeps free back to the kernel once the large requests in
    flight have all ended (`started` / `ended`, one of each per large request).

    The server lets glibc keep freed memory (tfserve.serving.process_tuning.keep_freed_memory) for
    the
    decoder's next join. The received message of a large request (up to
    --max-message-bytes), its parsed copy and its texts would then stay with the process
    once the request ended, and so would the most that large requests ever held at once.
    Not while a large request is in flight: its memory is still in use, and a flood of them
    would pay the page faults of each again. The trim (malloc_trim) runs on a thread of its
    own, one at a time: it took 15-17 ms after a 15 MB request, which the event loop would
    otherwise wait for. Requests that end while one runs are covered by the next.
    tfserve_large_requests_trimmed_total counts the large requests whose memory a finished
    trim handed back.
    """

    def __init__(self, metrics: Metrics, trim: Callable[[], object] = trim_freed_memory
                 ) -> None:
        self.metrics = metrics
        self.trim = trim
        self.in_flight = 0  # large requests not ended yet
        self._untrimmed = 0  # large requests ended since the last trim started
        self._running = False
        self._again = False  # the requests in flight all ended while a trim ran
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def started(self) -> None:
        self.in_flight += 1

    def ended(self) -> None:
        """On the event loop (or without one: then the trim runs at once)."""
        self.in_flight -= 1
        self._untrimmed += 1
        if self.in_flight == 0:
            self._start()

    def _start(self) -> None:
        if self._running:
            self._again = True
            return
        covered, self._untrimmed = self._untrimmed, 0
        self._running = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.trim()
            self._done(covered)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tfserve-trim")
        trimmed = loop.run_in_executor(self._executor, self.trim)
        trimmed.add_done_callback(lambda future: self._finished(future, covered))

    def _finished(self, future: asyncio.Future[object], covered: int) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("handing freed memory back failed: %r", future.exception())
        self._done(covered)

    def _done(self, covered: int) -> None:
        self._running = False
        self.metrics.large_requests_trimmed.inc(covered)
        if self._again:
            self._again = False
            if self.in_flight == 0 and self._untrimmed:
                self._start()


class Calls:
    """The server's calls: in-flight count and idle event, draining flag, RPC metrics, and
    the tracing of their spans (tfserve.serving.tracing; None: off). `release(model)` is
    called when a call that used a model ends (ModelRepository.release)."""

    def __init__(self, metrics: Metrics, max_message_bytes: int,
                 tracing: Tracing | None = None,
                 release: Callable[[LoadedModel], None] | None = None,
                 trim: Callable[[], object] = trim_freed_memory) -> None:
        """`trim`: hands freed memory back to the kernel (FreedMemory)."""
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.tracing = tracing
        self.release = release
        self.freed_memory = FreedMemory(metrics, trim)  # the large requests
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while no call is in flight
        self.idle.set()
        # labelled children, looked up once per (model, rpc, status); `model` is "" on a
        # server whose series have no model label (and for calls that used no model)
        self._rpc_metrics: dict[tuple[str, str, Status], tuple[Any, Any]] = {}
        self._token_metrics: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._first_token_metrics: dict[tuple[str, str], Any] = {}

    def _labels(self, model: str, *labels: str) -> tuple[str, ...]:
        """The label values of a per-request series: the model first on a by_model server."""
        return (model, *labels) if self.metrics.by_model else labels

    def started(self) -> None:
        self.in_flight += 1
        self.metrics.in_flight.inc()
        self.idle.clear()

    def finished(self, rpc: str, status: Status, seconds: float, model: str = "") -> None:
        metrics = self._rpc_metrics.get((model, rpc, status))
        if metrics is None:
            metrics = self._rpc_metrics[(model, rpc, status)] = (
                self.metrics.requests.labels(*self._labels(model, rpc, status.name)),
                self.metrics.request_seconds.labels(*self._labels(model, rpc)))
        metrics[0].inc()
        metrics[1].observe(seconds)
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if self.in_flight == 0:
            self.idle.set()

    def job_finished(self, rpc: str, job: Job, arrived: float, model: str = "") -> None:
        """The token metrics of a call's job: its input tokens and, when it decided one, its
        time to first token from the call's arrival (time.perf_counter() seconds).

        A stream's first token is the first the scheduler handed to its stream (a beam search
        streams nothing before it ends); a unary call's, the first one decided.
        """
        metrics = self._token_metrics.get((model, rpc))
        if metrics is None:
            labels = self._labels(model, rpc)
            metrics = self._token_metrics[(model, rpc)] = (
                self.metrics.input_tokens.labels(*labels),
                self.metrics.request_input_tokens.labels(*labels))
        metrics[0].inc(job.input_tokens)
        metrics[1].observe(job.input_tokens)
        times = job.times
        first = times.first_event if job.on_event is not None else times.first_token
        if first is not None:
            # created at an rpc's first token: Encode shows no empty histogram
            ttft = self._first_token_metrics.get((model, rpc))
            if ttft is None:
                ttft = self._first_token_metrics[(model, rpc)] = (
                    self.metrics.time_to_first_token.labels(*self._labels(model, rpc)))
            ttft.observe(first - arrived)


class Call:
    """One call: request id, deadline, in-flight count, the model it uses, metrics, access
    log, error status."""

    def __init__(self, calls: Calls, rpc: str, given_id: str = "", peer: str = "",
                 time_remaining: float | None = None,
                 invalid: InvalidArgument | None = None,
                 trace_carrier: Mapping[str, str] | None = None,
                 trace_name: str = "", service: str = SERVICE) -> None:
        """`trace_carrier`: the call's metadata or headers (name -> value), where the trace
        context the client sent is read when tracing is on (`traceparent`, `tracestate`);
        `service`: the API the rpc belongs to (its span's rpc.service); `trace_name` names its
        span (default "<service>/<rpc>")."""
        self.calls = calls
        self.rpc = rpc
        self.started = time.perf_counter()
        self.job: Job | None = None
        self.model: LoadedModel | None = None
        self.large = False  # counted in calls.freed_memory (received)
        self._model_name = ""  # the model's name, kept past its release for the span
        self.texts = 0
        self.peer = peer
        # raised by begin(): a message that did not parse, a bad id (Call.refuse)
        self.refusal: BaseException | None = invalid
        self.request_id = uuid.uuid4().hex
        if given_id:
            try:
                self.request_id = check_request_id(given_id)
            except InvalidArgument as exc:
                self.refuse(exc)
        # None (or, in some grpc versions, a huge value) when the client set no deadline
        self.deadline = (time.monotonic() + time_remaining
                         if time_remaining is not None and time_remaining < 1e8 else None)
        self.span: CallSpan | None = None  # with tracing on
        if calls.tracing is not None:
            self.span = calls.tracing.start(
                trace_name or f"{service}/{rpc}", rpc, self.request_id,
                trace_carrier, service)

    def received(self, size: int) -> None:
        """The request message is `size` bytes (as received: protobuf, or the JSON body).
        A large one is counted in Calls.freed_memory until `released` (by default when the
        call finishes), which then hands the memory back. Called once, before `finish`."""
        if size >= LARGE_REQUEST_BYTES and not self.large:
            self.large = True
            self.calls.freed_memory.started()

    # whether finish() counts a large request as released; a transport that knows a later
    # moment, when its own references to the request are gone too, calls released() then
    release_at_finish = True

    def released(self) -> None:
        """The call's request is no longer held (FreedMemory.ended, for a large one)."""
        if self.large:
            self.large = False
            self.calls.freed_memory.ended()

    def refuse(self, exc: BaseException) -> None:
        """The call fails with `exc` once it begins (unless it was refused for something
        else already): an error found before the core takes the call (a request that did
        not parse or convert), so that it is counted and logged like any failed call."""
        self.refusal = self.refusal or exc

    def begin(self) -> None:
        """Count the call in flight; refuse it while draining, or with its refusal. The
        core's RPC methods begin their call first thing."""
        self.calls.started()
        if self.calls.draining:
            raise Draining("the server is shutting down; retry on another replica")
        if self.refusal is not None:
            raise self.refusal

    async def accepted(self) -> None:
        """The call's job is queued: a transport that answers with its headers first (a
        gRPC stream) sends them now; nothing by default."""

    def use(self, model: LoadedModel) -> None:
        """The call runs on `model` (counted in its requests in flight by the repository):
        released when the call ends."""
        self.model = model

    def concerns(self, name: str) -> None:
        """The call is about the model `name` without running on it (ModelInfo of a model
        not loaded): counted and logged under that name."""
        self._model_name = name

    def span_error(self, status: Status) -> bool:
        """Whether a call that ends with `status` marks its span ERROR: OpenTelemetry's
        rule for gRPC server spans (an HTTP call overrides it with the rule for HTTP)."""
        return grpc_span_error(status)

    def check_size(self, size: int) -> None:
        """ResponseTooLarge when an answer of `size` bytes would be refused by the transport:
        then the failure is logged and counted as what the client sees."""
        limit = self.calls.max_message_bytes
        if size > limit:
            raise ResponseTooLarge(f"the response is {size} bytes, over the server's "
                                   f"--max-message-bytes of {limit}; ask for fewer texts or "
                                   "without hidden states")

    def watch(self, job: Job) -> asyncio.Future[list[Any]]:
        """A future of this loop for the job's results.

        The worker thread settles it directly (one call_soon_threadsafe per request). Unlike
        asyncio.wrap_future, cancelling the call does not cancel the job's future, so
        failed() can still record why (deadline or cancelled).
        """
        self.job = job
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[list[Any]] = loop.create_future()
        job.future.add_done_callback(
            lambda done: loop.call_soon_threadsafe(_settle, waiter, done))
        return waiter

    async def wait(self, job: Job) -> list[Any]:
        """The job's results; when the call is cancelled, the job is cancelled with it. The
        call is `accepted()` once the job is watched."""
        waiter = self.watch(job)
        await self.accepted()
        return await waiter

    def expired(self) -> bool:
        """Whether the client's deadline has passed (the transport ends the call right at it).

        From our own copy of the deadline: the call may be over, and the transport's context
        must not be used then. Ours was taken a moment after the transport's own: allow for
        the difference.
        """
        return self.deadline is not None and time.monotonic() >= self.deadline - 0.05

    def failed(self, exc: BaseException) -> tuple[Status, str]:
        """Record the failure (the job stops, metrics, access log); the status to answer.

        For CALL_ENDED (the client went away or its deadline passed) there is nobody to
        answer: the front end re-raises it, and the job's rows leave before the next step.
        """
        if isinstance(exc, CALL_ENDED):
            reason = "deadline" if self.expired() else "cancelled"
            if self.job is not None:
                self.job.cancel(reason)
            status = Status.DEADLINE_EXCEEDED if reason == "deadline" else Status.CANCELLED
            self.finish(status, reason)
            return status, reason
        status, details = status_for(exc)
        if status == Status.INTERNAL and not isinstance(exc, (ModelError, ModelLoadFailed)):
            log.error("%s %s failed", self.rpc, self.request_id, exc_info=exc)
        drop_tracebacks(exc)
        if self.job is not None:
            self.job.cancel()  # a failure outside the scheduler: stop its work too
        self.finish(status, details)
        return status, details

    def finish(self, status: Status, details: str = "") -> None:
        """Count the call as ended with `status`, write its access-log record, end its span."""
        elapsed = time.perf_counter() - self.started
        if self.release_at_finish:
            self.released()
        model = self.model
        name = self._model_name = model.name if model is not None else self._model_name
        self.calls.finished(self.rpc, status, elapsed, name)
        if self.job is not None:
            self.calls.job_finished(self.rpc, self.job, self.started, name)
        if model is not None and self.calls.release is not None:
            self.model = None
            self.calls.release(model)
        if self.span is not None:
            span, self.span = self.span, None
            self._end_span(span, status, details)
        if not access_log.isEnabledFor(logging.INFO):
            return
        record: dict[str, Any] = {
            "request_id": self.request_id,
            "rpc": self.rpc,
            "status": status.name,
            "texts": self.texts,
            "tokens": self.job.generated_tokens if self.job else 0,
            "queue_ms": round(self.job.queue_seconds * 1000, 3) if self.job else 0.0,
            "total_ms": round(elapsed * 1000, 3),
            "peer": self.peer,
        }
        if name:
            record["model"] = name
        if details and status != Status.OK:
            record["error"] = details
        access_log.info("request", extra={"fields": record})

    def _end_span(self, span: CallSpan, status: Status, details: str) -> None:
        """End the call's span; tracing never fails a call."""
        assert self.calls.tracing is not None
        try:
            self.calls.tracing.end(span, self.job, self.texts, status, details,
                                   self.span_error(status), self._model_name)
        except Exception:
            log.exception("%s %s: ending its trace span failed", self.rpc, self.request_id)


def drop_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of a failure that is answered (and logged already), and of the
    exceptions it was raised from or during.

    A traceback holds the frames the exception went through, with their variables: the
    request's message, its body, its texts. An exception kept in one of those frames (an
    `except ... as exc` that raises another, as messages.from_json does; a front end that
    keeps a body's error to raise once the call has begun) makes a reference cycle of them,
    freed by the cyclic garbage collector only. That collector counts objects, not bytes,
    and a refused request allocates few objects: 15 MB bodies that were not JSON, sent one
    after another over HTTP, were kept alive by the dozen.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += (current.__cause__, current.__context__)


def _settle(waiter: asyncio.Future[Any], done: concurrent.futures.Future[Any]) -> None:
    """On the event loop: pass a job's outcome on to the call awaiting it (unless it left)."""
    if waiter.done():  # the call was cancelled meanwhile
        return
    if done.cancelled():
        waiter.set_exception(Cancelled("request cancelled"))
    elif done.exception() is not None:
        waiter.set_exception(done.exception())  # type: ignore[arg-type]
    else:
        waiter.set_result(done.result())
