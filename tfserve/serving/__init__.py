"""The serving core: what a front end needs to serve the model, with no transport in it.

    status      Status, the serving errors, status_for (exception -> status, in one place)
    requests    plain requests (TranslateInput, EncodeInput, OptionFields); their checks,
                tokenization and submission to the scheduler (Submitter); check_request_id
    calls       per-call bookkeeping: in-flight count, request id, deadline, metrics by
                (rpc, status), one access-log record (Calls, Call)
    stream      streamed translation: tokens -> text deltas (TextDelta, TokenStream, Chunk)
    model_info  the model and the server's limits as plain data (ModelInfo)
    core        ServingCore: config, runtime, scheduler, metrics, calls; start and drain

The gRPC front end builds on it (`grpc_api`: the servicer, protobuf <-> plain requests,
Status -> grpc.StatusCode; `grpc_server`: the grpc.aio server, TLS, auth, health,
reflection). The modules above import no grpc, so another transport reuses them as they are.
"""

from tfserve.serving.calls import REQUEST_ID_KEY, Call, Calls
from tfserve.serving.core import ServingCore, load_runtime
from tfserve.serving.model_info import Limits, ModelInfo, ParitySummary
from tfserve.serving.requests import (
    EncodeInput,
    OptionFields,
    Submitter,
    TranslateInput,
    check_request_id,
    shown,
)
from tfserve.serving.status import (
    Draining,
    InvalidArgument,
    ResponseTooLarge,
    Status,
    status_for,
)
from tfserve.serving.stream import Chunk, TextDelta, TokenStream

__all__ = [
    "REQUEST_ID_KEY",
    "Call",
    "Calls",
    "Chunk",
    "Draining",
    "EncodeInput",
    "InvalidArgument",
    "Limits",
    "ModelInfo",
    "OptionFields",
    "ParitySummary",
    "ResponseTooLarge",
    "ServingCore",
    "Status",
    "Submitter",
    "TextDelta",
    "TokenStream",
    "TranslateInput",
    "check_request_id",
    "load_runtime",
    "shown",
    "status_for",
]
