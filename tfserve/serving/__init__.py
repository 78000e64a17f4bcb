"""The serving core: what a front end needs to serve the model, with no transport in it.

    status      Status, the serving errors, status_for (exception -> status, in one place)
    requests    plain requests (TranslateInput, EncodeInput, OptionFields); their checks,
                tokenization and submission to the scheduler (Submitter); check_request_id
    calls       per-call bookkeeping: in-flight count, request id, deadline, metrics by
                (rpc, status), one access-log record (Calls, Call)
    stream      streamed translation: tokens -> text deltas (TextDelta, TokenStream, Chunk)
    messages    the tfserve.v1 messages <-> plain requests and results, and their JSON
                mapping: one schema for every transport
    model_info  the model and the server's limits (the tfserve.v1 ModelInfo message)
    model_scan  a model repository directory: one Entry per model (name, version, memory)
    loaded      LoadedModel: one loaded version of a model, with its own scheduler and
                submitter; how an entry is loaded, how its memory goes back
    repository  ModelRepository: the models served; choosing, loading, unloading (LRU),
                rescanning, swapping versions
    core        ServingCore: config, models, metrics, calls; start and drain

The front ends build on it: gRPC (`grpc_api`: the servicer, Status -> grpc.StatusCode;
`grpc_server`: the grpc.aio server, TLS, auth, health, reflection) and HTTP/JSON
(`http_api`: the routes, server-sent events, Status -> HTTP status, auth, the OpenAPI document
of `openapi`; `http_server`: the aiohttp listener, TLS); `frontends` runs both around one
core. The modules above use neither grpc nor aiohttp, so each transport reuses them as they
are.
"""

from tfserve.serving.calls import REQUEST_ID_KEY, Call, Calls
from tfserve.serving.core import ServingCore, load_runtime
from tfserve.serving.loaded import LoadedModel
from tfserve.serving.messages import from_json, to_json
from tfserve.serving.model_info import Limits, ModelInfo, ParitySummary
from tfserve.serving.repository import ModelRepository, ModelStatus
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
    ModelCapacity,
    ModelLoadFailed,
    ModelNotFound,
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
    "LoadedModel",
    "ModelCapacity",
    "ModelInfo",
    "ModelLoadFailed",
    "ModelNotFound",
    "ModelRepository",
    "ModelStatus",
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
    "from_json",
    "load_runtime",
    "shown",
    "status_for",
    "to_json",
]
