"""The serving core: what a front end needs to serve the models, with no transport in it.

    status        Status, the serving errors, status_for (exception -> status, in one
                  place)
    served_model  what the core needs of a model it serves (ServedModel: a Backend with
                  its tokenizer, config and manifest; tfserve.runtime.Runtime is one)
    requests      plain requests (TranslateInput, EncodeInput, OptionFields); their checks,
                  tokenization and submission to the scheduler (Submitter)
    results       what a translation answers: each hypothesis with its text
                  (TextHypothesis)
    documents     a request's texts as documents: split into sentences (rows of the
                  batch), "text" or "html", source_language "auto"; the rows' hypotheses
                  joined back into each text's layout (TranslatedText, with segments)
    detection     the Detect RPC: each text's language (LanguageGuess)
    calls         per-call bookkeeping: in-flight count, request id, deadline, metrics by
                  (rpc, status), one access-log record (Calls, Call)
    stream        streamed translation: tokens -> text deltas (TextDelta, TokenStream,
                  Chunk; a document's segments in order: DocumentChunks)
    model_info    the model and the server's limits (the tfserve.v1 ModelInfo message)
    model_scan    a model repository directory: one Entry per model (name, version, memory)
    loaded        LoadedModel: one loaded version of a model, with its own scheduler and
                  submitter; how an entry is loaded, how its memory goes back
    model_slot    ModelSlot: a model's place in the repository, its state and health;
                  ModelStatus, as ListModels shows it
    repository    ModelRepository: the models served; choosing, loading, unloading (LRU),
                  rescanning, swapping versions
    core          ServingCore: config, models, metrics, calls; one method per RPC
                  (translate, translate_documents, translate_stream, detect, encode, model_info,
                  list_models); start
                  and drain

The front ends (tfserve.frontends: gRPC, HTTP/JSON) build on it and only convert their wire
format; tfserve.server runs them around one core. Nothing here uses grpc or aiohttp, so each
transport reuses it as it is.
"""

from tfserve.serving.calls import REQUEST_ID_KEY, Call, Calls
from tfserve.serving.core import ServingCore
from tfserve.serving.detection import LanguageGuess
from tfserve.serving.documents import DetectedLanguage, TranslatedSegment, TranslatedText
from tfserve.serving.loaded import LoadedModel
from tfserve.serving.model_info import Limits, ModelInfo, ParitySummary
from tfserve.serving.model_slot import ModelStatus
from tfserve.serving.repository import ModelRepository
from tfserve.serving.requests import (
    DetectInput,
    EncodeInput,
    OptionFields,
    Submitter,
    TranslateInput,
    check_request_id,
    shown,
)
from tfserve.serving.results import TextHypothesis
from tfserve.serving.served_model import ServedModel
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
    "DetectInput",
    "DetectedLanguage",
    "Draining",
    "EncodeInput",
    "InvalidArgument",
    "LanguageGuess",
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
    "ServedModel",
    "ServingCore",
    "Status",
    "Submitter",
    "TextDelta",
    "TextHypothesis",
    "TokenStream",
    "TranslateInput",
    "TranslatedSegment",
    "TranslatedText",
    "check_request_id",
    "shown",
    "status_for",
]
