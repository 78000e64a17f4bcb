"""The `tfserve.v1` messages (proto/tfserve/v1/translator.proto) <-> the core's plain values,
for both of tfserve's own front ends: the gRPC one sends the messages as protobuf, the HTTP
one as their JSON mapping (`to_json` / `from_json`), so both speak one schema, written once.

Requests become `TranslateInput` / `EncodeInput` / `DetectInput`; translations (a
document's segments and detected language with them), stream chunks, encodings, language
guesses and the repository's model statuses become response messages. Nothing here knows a
transport.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor_pb2 import FieldDescriptorProto
from google.protobuf.message import Message

from tfserve import option_table
from tfserve.proto import load as load_stubs
from tfserve.scheduler import Encoded
from tfserve.serving import (
    Chunk,
    DetectedLanguage,
    DetectInput,
    EncodeInput,
    InvalidArgument,
    LanguageGuess,
    ModelStatus,
    OptionFields,
    TextHypothesis,
    TranslatedSegment,
    TranslatedText,
    TranslateInput,
    shown,
)

pb2 = load_stubs()[0]


# -- requests -------------------------------------------------------------------------------


# the proto field types that carry each type of decoding option
_WIRE_TYPES = {
    int: (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT32,
          FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64),
    float: (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT),
    bool: (FieldDescriptor.TYPE_BOOL,),
}



def is_repeated(field: FieldDescriptor) -> bool:
    """Whether a message field is repeated, on every protobuf tfserve supports: its default
    is [] (protobuf 5 has no FieldDescriptor.is_repeated, 6 deprecates label)."""
    return field.default_value == []

def check_options(options: Sequence[option_table.Option] | None = None,
                  descriptor: Descriptor = pb2.DecodingOptions.DESCRIPTOR) -> None:
    """ValueError unless each declared decoding option (tfserve.option_table) is the field of
    its name in the proto's DecodingOptions, a single value of its type, and each field of
    that message is declared; the message names the option or field."""
    options = option_table.OPTIONS if options is None else options
    for declared in options:
        found = descriptor.fields_by_name.get(declared.name)
        where = f"{descriptor.full_name}.{declared.name}"
        if found is None:
            raise ValueError(f"decoding option {declared.name}: there is no field {where} "
                             "(proto/tfserve/v1/translator.proto; regenerate the stubs after "
                             "adding it)")
        repeated = is_repeated(found)
        if repeated or found.type not in _WIRE_TYPES[declared.type]:
            kind = FieldDescriptorProto.Type.Name(found.type).removeprefix("TYPE_").lower()
            raise ValueError(f"decoding option {declared.name} ({declared.type.__name__}) does "
                             f"not fit {where} ({'repeated ' if repeated else ''}{kind})")
    names = {declared.name for declared in options}
    undeclared = [found.name for found in descriptor.fields if found.name not in names]
    if undeclared:
        raise ValueError(f"{descriptor.full_name} field(s) {', '.join(undeclared)} not declared "
                         "in tfserve.option_table")


check_options()  # a table the wire does not carry stops the server at its start


def option_fields(message: Message) -> OptionFields:
    """proto DecodingOptions -> OptionFields, each declared option from the field of its
    name: a field at 0 (false), or an `optional` one left unset, is not given (None)."""
    values = {}
    for name in option_table.names():
        if message.DESCRIPTOR.fields_by_name[name].has_presence:
            values[name] = getattr(message, name) if message.HasField(name) else None
        else:
            values[name] = getattr(message, name) or None
    return OptionFields(**values)


def translate_input(request: Message) -> TranslateInput:
    """TranslateRequest -> TranslateInput."""
    return TranslateInput(model=request.model, texts=request.texts,
                          token_ids=[sequence.ids for sequence in request.token_ids],
                          truncate=request.truncate, options=option_fields(request.options),
                          source_language=request.source_language,
                          target_language=request.target_language,
                          target_prefix=request.target_prefix,
                          split_sentences=(request.split_sentences
                                           if request.HasField("split_sentences") else None),
                          format=request.format)


def detect_input(request: Message) -> DetectInput:
    """DetectRequest -> DetectInput."""
    return DetectInput(model=request.model, texts=request.texts)


def encode_input(request: Message) -> EncodeInput:
    """EncodeRequest -> EncodeInput."""
    return EncodeInput(model=request.model, texts=request.texts, truncate=request.truncate,
                       pooling=request.pooling,
                       return_hidden_states=request.return_hidden_states,
                       source_language=request.source_language)


# -- responses ------------------------------------------------------------------------------


def hypothesis(found: TextHypothesis) -> Message:
    """A Hypothesis message."""
    return pb2.Hypothesis(text=found.text, token_ids=found.token_ids, score=found.score)


def segment(found: TranslatedSegment) -> Message:
    """A Segment message: its spans, and its own hypotheses when there are several."""
    return pb2.Segment(source_start=found.source_start, source_end=found.source_end,
                       target_start=found.target_start, target_end=found.target_end,
                       hypotheses=[hypothesis(h) for h in found.hypotheses])


def _detected(detected: DetectedLanguage | None) -> dict[str, Any]:
    """The detected_language and confidence fields (none without detection)."""
    if detected is None:
        return {}
    return {"detected_language": detected.language, "confidence": detected.confidence}


def translation(result: TranslatedText) -> Message:
    """A Translation: its hypotheses in order, a document's segments, the language
    detected."""
    return pb2.Translation(hypotheses=[hypothesis(h) for h in result.hypotheses],
                           segments=[segment(found) for found in result.segments],
                           **_detected(result.detected))


def translate_response(results: Sequence[TranslatedText], request_id: str) -> Message:
    """A TranslateResponse: one Translation per input, in order."""
    return pb2.TranslateResponse(request_id=request_id,
                                 translations=[translation(result) for result in results])


def stream_response(chunk: Chunk, request_id: str) -> Message:
    """A TranslateStreamResponse for one chunk; the last of an input carries its final
    hypothesis (and every hypothesis, when there are several)."""
    if not chunk.done:
        return pb2.TranslateStreamResponse(index=chunk.index, request_id=request_id,
                                           text_delta=chunk.text_delta,
                                           token_ids=chunk.token_ids, segment=chunk.segment,
                                           separator=chunk.separator)
    assert chunk.final is not None
    message = pb2.TranslateStreamResponse(
        index=chunk.index, request_id=request_id, done=True, text_delta=chunk.text_delta,
        token_ids=chunk.token_ids, final=hypothesis(chunk.final), segment=chunk.segment,
        separator=chunk.separator, segments=[segment(found) for found in chunk.segments],
        **_detected(chunk.detected))
    if chunk.hypotheses:
        message.hypotheses.extend(hypothesis(h) for h in chunk.hypotheses)
    return message


def detect_response(guesses: Sequence[LanguageGuess], request_id: str) -> Message:
    """A DetectResponse: one Detection per text, in order."""
    return pb2.DetectResponse(request_id=request_id, detections=[pb2.Detection(
        language=guess.language, confidence=guess.confidence,
        model_language=guess.model_language) for guess in guesses])


def encode_response(results: Sequence[Encoded], request_id: str) -> Message:
    """An EncodeResponse from the scheduler's encodings (embedding, token ids, and the
    per-token hidden states when asked for)."""
    embeddings = []
    for encoded in results:
        message = pb2.Embedding(embedding=encoded.embedding.tolist(),
                                num_tokens=len(encoded.token_ids),
                                dim=int(encoded.embedding.shape[-1]),
                                token_ids=encoded.token_ids)
        if encoded.hidden_states is not None:
            message.hidden_states.extend(encoded.hidden_states.ravel().tolist())  # [len*D]
        embeddings.append(message)
    return pb2.EncodeResponse(embeddings=embeddings, request_id=request_id)


def list_models_response(statuses: Sequence[ModelStatus], default_model: str) -> Message:
    """A ListModelsResponse: every model of the repository with its state."""
    return pb2.ListModelsResponse(default_model=default_model, models=[pb2.ModelStatus(
        name=status.name, state=pb2.ModelState.Value(f"MODEL_STATE_{status.state.upper()}"),
        version=status.version, loaded_version=status.loaded_version,
        model_name=status.model_name, source_language=status.source_language,
        target_language=status.target_language, memory_bytes=status.memory_bytes,
        in_flight=status.in_flight, last_error=status.last_error,
        is_default=status.is_default) for status in statuses])


# -- the JSON mapping -----------------------------------------------------------------------


def from_json(body: bytes, message_class: type[Message]) -> Message:
    """A request message from its JSON mapping (lowerCamelCase or proto field names), or
    InvalidArgument saying what is wrong: not JSON, not an object, a key given twice, a
    field name that is not text, an unknown field, a value of the wrong type (the message
    names the field)."""
    name = message_class.DESCRIPTOR.name
    try:
        document = json.loads(body, object_pairs_hook=_unique_keys)
    except InvalidArgument:
        raise
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidArgument(f"the request body must be a JSON object (a {name}), "
                              f"not {_json_type(document)}")
    try:
        _check_shape(document, message_class.DESCRIPTOR, "")
        return json_format.ParseDict(document, message_class())
    except (json_format.ParseError, RecursionError) as exc:
        # json_format's messages name the field (and may run over several lines)
        raise InvalidArgument(f"the request body is not a valid {name}: "
                              f"{' '.join(str(exc).split())}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook: an object, or InvalidArgument for a key given twice
    (JSON parsers differ in which of the two they keep, so neither is taken)."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise InvalidArgument(f"the request body gives the key {shown(key)} more than "
                                  "once")
        document[key] = value
    return document


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}[type(value)]


_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


def _check_shape(document: dict[str, Any], descriptor: Descriptor, path: str) -> None:
    """What json_format lets through or fails on without naming the field: a field name that
    is not text (an unpaired surrogate escape: json_format raises SystemError on it), one
    field under both of its names, a message field given something other than an object
    (json_format takes `"options": []` as empty options) and a boolean for a floating-point
    field (json_format takes `false` as 0.0)."""
    named: dict[str, str] = {}
    for key, value in document.items():
        if _unpaired_surrogate(key):
            raise InvalidArgument(f"{path or 'the request body'}: the field name {shown(key)} "
                                  "is not text (an unpaired surrogate)")
        field = (descriptor.fields_by_camelcase_name.get(key)
                 or descriptor.fields_by_name.get(key))
        if field is None:
            continue  # json_format names the unknown field
        where = f"{path}.{key}" if path else key
        if field.name in named:
            raise InvalidArgument(f"{where}: the field is given twice (also as "
                                  f"{shown(named[field.name])})")
        named[field.name] = key
        values = value if is_repeated(field) and isinstance(value, list) else [value]
        if field.type in _FLOATS and any(isinstance(item, bool) for item in values):
            raise InvalidArgument(f"{where} must be a number, not a boolean")
        if field.type != FieldDescriptor.TYPE_MESSAGE or value is None:
            continue
        if is_repeated(field):
            if not isinstance(value, list):
                continue  # json_format names the field
            items = [(f"{where}[{index}]", item) for index, item in enumerate(value)]
        else:
            items = [(where, value)]
        for place, item in items:
            if item is None:
                continue  # json_format names a null element of a repeated field
            if not isinstance(item, dict):
                raise InvalidArgument(f"{place} must be a JSON object (a "
                                      f"{field.message_type.name}), not {_json_type(item)}")
            _check_shape(item, field.message_type, place)


def _unpaired_surrogate(text: str) -> bool:
    """Whether `text` holds a lone UTF-16 surrogate (JSON's \\ud800 escape): not encodable."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def to_dict(message: Message) -> dict[str, Any]:
    """A message as its JSON mapping: lowerCamelCase names, int64 as strings, fields at
    their default left out."""
    return json_format.MessageToDict(message)


def to_json(message: Message) -> bytes:
    """A message as compact JSON (UTF-8)."""
    return json.dumps(to_dict(message), ensure_ascii=False,
                      separators=(",", ":")).encode("utf-8")
