"""The Open Inference Protocol's tensors <-> the serving core's plain values, for both of the
protocol's transports (REST: tfserve.frontends.oip_rest, gRPC: tfserve.frontends.oip_grpc).

Each transport parses its wire format into an `InferRequest` (tensors as `Tensor`s, BYTES
elements as bytes, parameters as plain Python values) and renders the `Tensor`s made here;
everything between (which tensors and parameters a model takes, their checks, the core's
request, the result's tensors) is here, once, as pure functions.

A translation model (docs/server.md, "Open Inference Protocol"):

    inputs   text           BYTES [N] (or [N, 1])  UTF-8 texts, at most --max-texts-per-request
             target_prefix  BYTES [1] or [N]       optional: text each translation starts with
    outputs  translation    BYTES [N]              the best translation of each text; [N, K]
                                                   with num_return_sequences K > 1
             score          FP32, as translation   each translation's score
    parameters  source_language (a code, or "auto"), target_language, target_prefix
                (string), truncate (bool), split_sentences (bool, default true: each text a
                document, docs/documents.md), format ("text" or "html"), and every
                decoding option of the native API under its own name and limits
                (max_new_tokens, num_beams, temperature, ...)

An encoder model (decoder_layers 0) takes `text` and gives `embedding` FP32 [N, D], with the
parameters pooling (mean, max, first), truncate and source_language.

A streamed translation (gRPC ModelStreamInfer) answers each text's text as it is decided:
every response holds `translation` BYTES [1], a text delta, and the parameters `index` (the
text's place in the request), `segment` (a document's segment, in order; left out for
the first) and `done`; an input's last response also holds `score` (and, with
source_language "auto", `detected_language` and `confidence`), and the request's last one
carries `triton_final_response: true`.

Bad input is an InvalidArgument naming the protocol's field (`inputs[0].datatype`,
`parameters.num_beams`, `text[2]`); the core's own checks name the native API's fields, which
`protocol_field_names` turns into the protocol's. A client's value in a message is cut as the
native API cuts it (a string by tfserve.serving.requests.shown, to 40 characters; any other
value by `shown_value`, a shape by `shape_text`); whatever else reading a request raises is
InvalidArgument too (`request_reading`), and `protocol_error` bounds every message a protocol
call answers or logs to MAX_ERROR_CHARS.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tfserve import option_table
from tfserve.scheduler import Encoded
from tfserve.serving import ServingCore
from tfserve.serving.calls import Call
from tfserve.serving.requests import EncodeInput, OptionFields, TranslateInput, shown
from tfserve.serving.results import TextHypothesis
from tfserve.serving.status import InvalidArgument, ModelNotFound
from tfserve.serving.stream import Chunk

# the tensors' names
TEXT = "text"
TARGET_PREFIX = "target_prefix"
TRANSLATION = "translation"
SCORE = "score"
EMBEDDING = "embedding"

PLATFORM = "tfserve"  # a model's `platform` in its metadata (the KServe model format's name)
# the protocol's gRPC service: its rpcs' names (ModelInfer, ...) are the calls' over REST too
SERVICE_NAME = "inference.GRPCInferenceService"

BYTES = "BYTES"
FP32 = "FP32"

# parameters of the protocol's transports rather than of a model: read by the transports,
# let through by the checks here
BINARY_DATA_OUTPUT = "binary_data_output"  # REST: every output as binary data
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"  # gRPC stream: the final flag
FINAL_RESPONSE = "triton_final_response"  # a stream response's parameter: the request's last
TIMEOUT = "timeout"  # the request's deadline, in microseconds (Triton's parameter)
MAX_TIMEOUT_US = 86_400_000_000  # one day, as the native x-request-timeout-ms header
TRANSPORT_PARAMETERS: dict[str, type] = {
    BINARY_DATA_OUTPUT: bool, EMPTY_FINAL_RESPONSE: bool, TIMEOUT: int}

# the parameters of each kind of model besides the decoding options, with their types
_TRANSLATE_PARAMETERS: dict[str, type] = {
    "source_language": str, "target_language": str, TARGET_PREFIX: str, "truncate": bool,
    "split_sentences": bool, "format": str}
_ENCODE_PARAMETERS: dict[str, type] = {"source_language": str, "pooling": str, "truncate": bool}

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
# the integers a parameter takes: gRPC's int64_param and uint64_param (JSON's are unbounded,
# and float() of a longer one overflows)
_INT_RANGE = (-(2 ** 63), 2 ** 64 - 1)
# the most characters of an error message a protocol call answers or logs: a message names a
# field and quotes client strings cut to 40 characters (shown), so a legitimate one is
# shorter (the longest, NOT_FOUND's list of the models served, may be cut); the bound is the
# net under that, inside the 8 KiB gRPC's trailers take (grpc-message is the message's UTF-8,
# percent-encoded past ASCII: ASCII text, which messages are but for quoted client strings,
# takes a byte a character)
MAX_ERROR_CHARS = 1000


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as model metadata lists it: name, data type, shape (-1: any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Tensor:
    """A tensor of a request or a response: its elements flattened in row-major order (BYTES
    elements as bytes in a request, as str in a response; numbers as a numpy array or a
    list), its parameters as plain values."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InferRequest:
    """An inference request as either transport parses it. `outputs`: the names of the
    outputs asked for, in order (empty: every output of the model)."""

    model: str
    version: str = ""
    id: str = ""
    inputs: Sequence[Tensor] = ()
    outputs: Sequence[str] = ()
    parameters: Mapping[str, Any] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        """The id the native front ends call request_id (what Call reads)."""
        return self.id


# -- model metadata ---------------------------------------------------------------------------


def model_inputs(encoder_only: bool) -> tuple[TensorSpec, ...]:
    """The inputs a model takes."""
    text = TensorSpec(TEXT, BYTES, (-1,))
    return (text,) if encoder_only else (text, TensorSpec(TARGET_PREFIX, BYTES, (-1,)))


def model_outputs(encoder_only: bool, dim: int) -> tuple[TensorSpec, ...]:
    """The outputs a model gives (`dim`: its embeddings' size)."""
    if encoder_only:
        return (TensorSpec(EMBEDDING, FP32, (-1, dim)),)
    return TensorSpec(TRANSLATION, BYTES, (-1,)), TensorSpec(SCORE, FP32, (-1,))


# -- requests -------------------------------------------------------------------------------


def translate_input(request: InferRequest) -> TranslateInput:
    """An inference request to a translation model as the core's TranslateInput."""
    _check_outputs(request, model_outputs(False, 0))
    inputs = _named_inputs(request, model_inputs(False))
    texts = _texts(inputs[TEXT], TEXT)
    given = _parameters(request, {**_TRANSLATE_PARAMETERS, **option_types()})
    prefixes: Sequence[str] = ()
    if TARGET_PREFIX in inputs:
        if TARGET_PREFIX in given:
            raise InvalidArgument("target_prefix is given both as an input and as a parameter: "
                                  "give one")
        prefixes = _texts(inputs[TARGET_PREFIX], TARGET_PREFIX, allow_empty=True)
    elif TARGET_PREFIX in given:
        prefixes = (given[TARGET_PREFIX],)
    options = OptionFields(**{name: value for name, value in given.items()
                              if name in option_types()})
    return TranslateInput(model=request.model, version=request.version, texts=texts,
                          truncate=given.get("truncate", False), options=options,
                          source_language=given.get("source_language", ""),
                          target_language=given.get("target_language", ""),
                          target_prefix=prefixes,
                          split_sentences=given.get("split_sentences"),
                          format=given.get("format", ""))


def encode_input(request: InferRequest) -> EncodeInput:
    """An inference request to an encoder model as the core's EncodeInput."""
    _check_outputs(request, model_outputs(True, 0))
    inputs = _named_inputs(request, model_inputs(True))
    given = _parameters(request, _ENCODE_PARAMETERS)
    return EncodeInput(model=request.model, version=request.version,
                       texts=_texts(inputs[TEXT], TEXT), truncate=given.get("truncate", False),
                       pooling=given.get("pooling", ""),
                       source_language=given.get("source_language", ""))


def option_types() -> dict[str, type]:
    """The decoding options a request may set, by name, with their types (int, float, bool):
    the native API's (tfserve.option_table)."""
    return {option.name: option.type for option in option_table.OPTIONS}


def request_timeout(request: InferRequest) -> float | None:
    """The `timeout` parameter in seconds (None: not given), or InvalidArgument."""
    value = request.parameters.get(TIMEOUT)
    if value is None:
        return None
    _check_type(TIMEOUT, value, int)
    if not 1 <= value <= MAX_TIMEOUT_US:
        raise InvalidArgument(f"parameters.timeout must be in [1, {MAX_TIMEOUT_US}] "
                              f"microseconds, got {shown_value(value)}")
    return value / 1e6


def wants_binary(request: InferRequest) -> bool:
    """Whether the request asks for every output as binary data (REST)."""
    value = request.parameters.get(BINARY_DATA_OUTPUT, False)
    _check_type(BINARY_DATA_OUTPUT, value, bool)
    return bool(value)


def core_request(core: ServingCore, call: Call, request: InferRequest
                 ) -> TranslateInput | EncodeInput:
    """The core's request for an inference request (EncodeInput for an encoder model), with
    its `timeout` parameter applied to the call's deadline. Whatever is wrong with it (a
    bad input, a model not served) becomes the call's refusal, raised when the core begins
    the call (so that it is counted and logged like any failed call)."""
    try:
        timeout = request_timeout(request)
        if timeout is not None:
            deadline = time.monotonic() + timeout
            call.deadline = deadline if call.deadline is None else min(call.deadline, deadline)
        slot = core.repository.slot(request.model, request.version)
        model = slot.model
        encoder_only = (bool(model.runtime.config.encoder_only) if model is not None
                        else slot.entry.encoder_only)
        with request_reading():
            return encode_input(request) if encoder_only else translate_input(request)
    except Exception as exc:
        call.refuse(exc)
        return TranslateInput(model=request.model, version=request.version)


async def infer_outputs(core: ServingCore, call: Call, request: InferRequest) -> list[Tensor]:
    """An inference request run by the core: its model's translations (the outputs it names)
    or embeddings, as the protocol's tensors."""
    given = core_request(core, call, request)
    if isinstance(given, EncodeInput):
        return embedding_outputs(await core.encode(call, given))
    return translation_outputs(await core.translate(call, given), request.outputs)


def answered_model(call: Call, request: InferRequest) -> tuple[str, str]:
    """The model name and version an answer names: the version that served the call, else
    the request's own (a call refused before a model took it)."""
    model = call.model
    return (model.name, model.version) if model is not None else (request.model,
                                                                   request.version)


def _check_outputs(request: InferRequest, offered: Sequence[TensorSpec]) -> None:
    names = [spec.name for spec in offered]
    for index, name in enumerate(request.outputs):
        if name not in names:
            raise InvalidArgument(f"outputs[{index}].name is {shown(name)}, not an output of "
                                  f"this model; its outputs are {', '.join(names)}")
        if name in request.outputs[:index]:
            raise InvalidArgument(f"outputs[{index}].name: the output {shown(name)} is asked "
                                  "for twice")


def _named_inputs(request: InferRequest, taken: Sequence[TensorSpec]) -> dict[str, Tensor]:
    """The request's inputs by name, each one the model takes, of its data type, given once;
    `text` among them."""
    specs = {spec.name: spec for spec in taken}
    found: dict[str, Tensor] = {}
    for index, tensor in enumerate(request.inputs):
        spec = specs.get(tensor.name)
        if spec is None:
            raise InvalidArgument(f"inputs[{index}].name is {shown(tensor.name)}, not an input "
                                  f"of this model; its inputs are {', '.join(specs)}")
        if tensor.name in found:
            raise InvalidArgument(f"inputs[{index}].name: the input {shown(tensor.name)} is "
                                  "given twice")
        if tensor.datatype != spec.datatype:
            raise InvalidArgument(f"inputs[{index}].datatype of {shown(tensor.name)} must be "
                                  f"{spec.datatype}, got {shown(tensor.datatype)}")
        found[tensor.name] = tensor
    if TEXT not in found:
        raise InvalidArgument(f"inputs: the input {TEXT!r} (BYTES [N], the texts) is missing")
    return found


def _texts(tensor: Tensor, name: str, allow_empty: bool = False) -> list[str]:
    """A BYTES tensor of shape [N] or [N, 1] as N texts (UTF-8)."""
    shape = tuple(tensor.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or any(
            size < 0 for size in shape):
        raise InvalidArgument(f"{name}: the shape must be [N] or [N, 1], got "
                              f"{shape_text(shape)}")
    elements = list(tensor.data)
    if len(elements) != shape[0]:
        raise InvalidArgument(f"{name}: the shape {shape_text(shape)} holds "
                              f"{shown_value(shape[0])} elements, the data {len(elements)}")
    texts = []
    for index, element in enumerate(elements):
        try:
            text = element.decode("utf-8") if isinstance(element, bytes) else element
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"{name}[{index}] is not UTF-8 text ({exc.reason} at byte "
                                  f"{exc.start})") from None
        if not isinstance(text, str):
            raise InvalidArgument(f"{name}[{index}] must be a string, got "
                                  f"{type(text).__name__}")
        texts.append(text)
    if not texts and not allow_empty:
        raise InvalidArgument(f"{name} must not be empty (the shape is [0])")
    return texts


def _parameters(request: InferRequest, types: Mapping[str, type]) -> dict[str, Any]:
    """The request's model parameters, each of its type; InvalidArgument naming an unknown
    one (the transports' own parameters pass)."""
    given: dict[str, Any] = {}
    for name, value in request.parameters.items():
        kind = types.get(name)
        if kind is None:
            if name in TRANSPORT_PARAMETERS:
                continue
            raise InvalidArgument(f"{parameter_field(name)} is not a parameter of this "
                                  f"model; its parameters are {', '.join(sorted(types))}")
        _check_type(name, value, kind)
        given[name] = float(value) if kind is float else value
    return given


def _check_type(name: str, value: Any, kind: type) -> None:
    """InvalidArgument naming `parameters.<name>` unless value is of `kind` (an int serves as
    a float; a bool is neither), an integer in gRPC's 64 bits, a string UTF-8 text (JSON's
    escapes can write a lone surrogate, which no tokenizer takes)."""
    accepted = (int, float) if kind is float else kind
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
        raise InvalidArgument(f"parameters.{name} must be {_TYPE_NAMES[kind]}, got "
                              f"{shown_value(value)}")
    if isinstance(value, int) and not isinstance(value, bool) and not (
            _INT_RANGE[0] <= value <= _INT_RANGE[1]):
        raise InvalidArgument(f"parameters.{name} must fit in 64 bits, got "
                              f"{shown_value(value)}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"parameters.{name} is not UTF-8 text (a lone surrogate at "
                                  f"character {exc.start})") from None


# -- client values in messages --------------------------------------------------------------

_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def parameter_field(name: str) -> str:
    """A parameter's field for a message: `parameters.<name>` for a name that reads plainly
    (a short identifier), else `parameters[<the name as shown quotes it>]`, so that a long
    or odd name is cut and quoted once, whole."""
    return f"parameters.{name}" if _PLAIN_NAME.fullmatch(name) else f"parameters[{shown(name)}]"


def shown_value(value: Any) -> str:
    """A client's value of any type for a message, never more than about 40 characters of
    it: a string as `shown` quotes it, a number or a boolean as written while it is short,
    anything else by its kind and size (`a list of 300000 items`, `an object`)."""
    if isinstance(value, str):
        return shown(value)
    if value is None:
        return "null"
    if isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        try:
            digits = len(str(abs(value)))
        except ValueError:  # past Python's int-to-str limit (sys.get_int_max_str_digits)
            return "an integer of thousands of digits"
        return repr(value) if digits <= 40 else f"an integer of {digits} digits"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def shape_text(shape: Sequence[int]) -> str:
    """A client's shape for a message: as a list while short, else its first 40 characters
    and its rank."""
    text = str(list(shape)) if len(shape) <= 40 else ""
    if text and len(text) <= 40:
        return text
    rank = f"{len(shape)} dimension{'' if len(shape) == 1 else 's'}"
    return f"{str(list(shape[:20]))[:40]}... ({rank})"


def bounded(message: str) -> str:
    """An error message as the protocol answers and logs it: encodable (a lone surrogate
    written as its escape: aiohttp's and gRPC's UTF-8 would refuse it) and at most
    MAX_ERROR_CHARS characters (a longer one cut, saying how long it was)."""
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) <= MAX_ERROR_CHARS:
        return message
    cut = f"... ({len(message)} characters)"
    return message[:MAX_ERROR_CHARS - len(cut)] + cut


@contextmanager
def request_reading() -> Iterator[None]:
    """Read and convert a request in this block: whatever it raises is the request's fault
    and InvalidArgument. The checks name the field; this is the net under them, so that a
    request they miss is a 400 / INVALID_ARGUMENT with a short message, never INTERNAL with
    a traceback in the log."""
    try:
        yield
    except (InvalidArgument, ModelNotFound):
        raise
    except (ValueError, TypeError, LookupError, ArithmeticError, RecursionError) as exc:
        # `from None`: the traceback's frames hold the request
        raise InvalidArgument(f"the request cannot be read ({type(exc).__name__}: "
                              f"{shown(str(exc))})") from None


# the native API's field names at the start of the core's messages -> the protocol's
_NATIVE_FIELDS = ((re.compile(r"^texts\b"), TEXT), (re.compile(r"^options\."), "parameters."),
                  (re.compile(r"^(source_language|target_language|pooling|truncate|format"
                              r"|split_sentences)\b"),
                   r"parameters.\1"))


def protocol_field_names(message: str) -> str:
    """A core InvalidArgument's message with the native field it starts with named as the
    protocol names it (`texts[1]` -> `text[1]`, `options.num_beams` -> `parameters.num_beams`,
    `target_language` -> `parameters.target_language`)."""
    for pattern, replacement in _NATIVE_FIELDS:
        if pattern.match(message):
            return pattern.sub(replacement, message, count=1)
    return message


def protocol_error(exc: BaseException) -> BaseException:
    """A call's failure as the protocol's front ends answer and log it (the one place both
    transports' calls pass it through: their `failed`): an InvalidArgument of the core with
    its field named as the protocol names it, any message `bounded`; the same exception when
    there is nothing to change, or one of the same type (and traceback) with the new message.
    """
    if not isinstance(exc, Exception):
        return exc  # the client left (CancelledError, GeneratorExit): nothing is answered
    message = str(exc)
    changed = bounded(protocol_field_names(message) if isinstance(exc, InvalidArgument)
                      else message)
    if changed == message:
        return exc
    try:
        remade = type(exc)(changed)
    except Exception:  # an exception not made of its message: answered as it is (bounded
        return exc     # by the transport), logged as it is
    if str(remade) != changed:
        return exc
    return remade.with_traceback(exc.__traceback__)


# -- results --------------------------------------------------------------------------------


def translation_outputs(results: Sequence[Sequence[TextHypothesis]],
                        wanted: Sequence[str] = ()) -> list[Tensor]:
    """The translation and score tensors of a translate result (each input's hypotheses, in
    order): shape [N], or [N, K] for K hypotheses per input; `wanted` names the outputs to
    give, in order (empty: both)."""
    per_input = len(results[0]) if results else 1
    shape = (len(results),) if per_input == 1 else (len(results), per_input)
    texts = [found.text for hypotheses in results for found in hypotheses]
    scores = np.asarray([found.score for hypotheses in results for found in hypotheses],
                        dtype=np.float32)
    made = {TRANSLATION: Tensor(TRANSLATION, BYTES, shape, texts),
            SCORE: Tensor(SCORE, FP32, shape, scores)}
    return [made[name] for name in (wanted or (TRANSLATION, SCORE))]


def embedding_outputs(results: Sequence[Encoded]) -> list[Tensor]:
    """The embedding tensor [N, D] of an encode result."""
    embeddings = np.stack([np.asarray(encoded.embedding, dtype=np.float32)
                           for encoded in results])
    return [Tensor(EMBEDDING, FP32, tuple(embeddings.shape), embeddings.ravel())]


def chunk_outputs(chunk: Chunk) -> tuple[list[Tensor], dict[str, Any]]:
    """The tensors and parameters of one streamed chunk's response (the text delta of input
    `index`; its last chunk with the score of its best translation)."""
    outputs = [Tensor(TRANSLATION, BYTES, (1,), [chunk.text_delta])]
    parameters: dict[str, Any] = {"index": chunk.index, "done": chunk.done}
    if chunk.segment:  # a document's later segment (0, the first, is left out)
        parameters["segment"] = chunk.segment
    if chunk.done and chunk.final is not None:
        outputs.append(Tensor(SCORE, FP32, (1,), np.asarray([chunk.final.score], np.float32)))
    if chunk.detected is not None:
        parameters.update(detected_language=chunk.detected.language,
                          confidence=chunk.detected.confidence)
    return outputs, parameters


def check_streamable(request: TranslateInput) -> None:
    """A stream answers each input's best translation: InvalidArgument for a request that
    asks for several."""
    count = request.options.num_return_sequences
    if count is not None and count > 1:
        raise InvalidArgument("parameters.num_return_sequences: a stream (ModelStreamInfer) "
                              "answers the best translation of each text; ask ModelInfer "
                              f"for {count} per text")


# -- raw contents ---------------------------------------------------------------------------

_LENGTH = struct.Struct("<I")


def bytes_elements(raw: bytes | memoryview, name: str) -> list[bytes]:
    """BYTES elements from their raw form (each one's length as 4 little-endian bytes, then
    its bytes), or InvalidArgument naming the field `name` (`inputs[0]`, not the client's
    tensor name)."""
    view = memoryview(raw)
    elements, offset = [], 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise InvalidArgument(f"{name}: the raw BYTES contents end inside an element's "
                                  f"4-byte length (at byte {offset} of {len(view)})")
        (size,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + size > len(view):
            raise InvalidArgument(f"{name}: a raw BYTES element of {size} bytes runs past the "
                                  f"end of the contents (at byte {offset} of {len(view)})")
        elements.append(bytes(view[offset:offset + size]))
        offset += size
    return elements


def raw_contents(tensor: Tensor) -> bytes:
    """A response tensor's elements in raw form (BYTES length-prefixed, FP32 little-endian)."""
    if tensor.datatype == BYTES:
        parts = []
        for element in tensor.data:
            encoded = element.encode("utf-8") if isinstance(element, str) else bytes(element)
            parts += (_LENGTH.pack(len(encoded)), encoded)
        return b"".join(parts)
    return np.ascontiguousarray(tensor.data, dtype="<f4").tobytes()
