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
joins them together when the wait ends: `BatchingPolicy.gather_deadline`,
`SchedulerConfig.encode_ahead`), so a request that arrives while others are decoding joins at
the next step instead of waiting for the running batch to finish, and the rows a finished or
cancelled request frees are reused at once. Encode requests (sentence embeddings) go through
the same worker, batched the same way.

Results are delivered through a `concurrent.futures.Future` per request (`Job.future`); the
gRPC server awaits it with `asyncio.wrap_future`, which hands the result to the event loop with
`call_soon_threadsafe`. Streaming callbacks run on the worker thread and must only hand off.
This package knows nothing about gRPC: errors are the exception classes of `jobs`, which the
server maps to status codes in one place.

Modules: `config` (SchedulerConfig, the batching settings), `jobs` (requests, work items,
results, errors, counters), `policy` (BatchingPolicy: what is admitted when; no thread),
`encoding` (encoder runs), `worker` (Scheduler: the thread and the model runs).
"""

from tfserve.scheduler.jobs import (
    Cancelled,
    DeadlineExceeded,
    Encoded,
    Job,
    JobTimes,
    ModelError,
    QueueFull,
    SchedulerError,
    SchedulerStats,
    StreamEvent,
    Unavailable,
    WorkItem,
)
from tfserve.scheduler.policy import BatchingPolicy, Running, Take, TakeMode
from tfserve.scheduler.scheduler import Scheduler
from tfserve.scheduler.scheduler_config import SchedulerConfig

__all__ = [
    "BatchingPolicy",
    "Cancelled",
    "DeadlineExceeded",
    "Encoded",
    "Job",
    "JobTimes",
    "ModelError",
    "QueueFull",
    "Running",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "StreamEvent",
    "Take",
    "TakeMode",
    "Unavailable",
    "WorkItem",
]
