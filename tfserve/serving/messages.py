"""The `tfserve.v1` messages (proto/tfserve/v1/translator.proto) <-> the core's plain values,
for every front end: the gRPC adapter sends the messages as protobuf, the HTTP adapter as
their JSON mapping (`to_json` / `from_json`), so both speak one schema, written once.

Requests become `TranslateInput` / `EncodeInput`; hypotheses, stream chunks, encodings and
the repository's model statuses become response messages. Nothing here knows a transport.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import json_format

from tfserve.generation import Hypothesis
from tfserve.proto import load as load_stubs
from tfserve.serving.repository import ModelStatus
from tfserve.serving.requests import EncodeInput, OptionFields, TranslateInput
from tfserve.serving.status import InvalidArgument
from tfserve.serving.stream import Chunk

pb2 = load_stubs()[0]

Decode = Callable[[list[int]], str]  # token ids -> text (the tokenizer's decode)


# -- requests -------------------------------------------------------------------------------


def option_fields(message: Any) -> OptionFields:
    """proto DecodingOptions -> OptionFields: a field at 0 (false), or an `optional` one
    left unset, is not given (None)."""

    def optional(name: str) -> Any:
        return getattr(message, name) if message.HasField(name) else None

    def nonzero(name: str) -> Any:
        return getattr(message, name) or None

    return OptionFields(
        max_new_tokens=nonzero("max_new_tokens"),
        min_new_tokens=optional("min_new_tokens"),
        num_beams=nonzero("num_beams"),
        length_penalty=optional("length_penalty"),
        early_stopping=optional("early_stopping"),
        num_return_sequences=nonzero("num_return_sequences"),
        do_sample=nonzero("do_sample"),
        temperature=optional("temperature"),
        top_k=nonzero("top_k"),
        top_p=optional("top_p"),
        seed=optional("seed"),
        repetition_penalty=optional("repetition_penalty"),
        no_repeat_ngram_size=optional("no_repeat_ngram_size"),
    )


def translate_input(request: Any) -> TranslateInput:
    """TranslateRequest -> TranslateInput."""
    return TranslateInput(texts=request.texts,
                          token_ids=[sequence.ids for sequence in request.token_ids],
                          truncate=request.truncate, options=option_fields(request.options),
                          source_language=request.source_language,
                          target_language=request.target_language,
                          target_prefix=request.target_prefix)


def encode_input(request: Any) -> EncodeInput:
    """EncodeRequest -> EncodeInput."""
    return EncodeInput(texts=request.texts, truncate=request.truncate, pooling=request.pooling,
                       return_hidden_states=request.return_hidden_states,
                       source_language=request.source_language)


# -- responses ------------------------------------------------------------------------------


def hypothesis(found: Hypothesis, decode: Decode, text: str | None = None) -> Any:
    """A Hypothesis message; its text decoded unless given."""
    if text is None:
        text = decode(found.token_ids)
    return pb2.Hypothesis(text=text, token_ids=found.token_ids, score=found.score)


def translate_response(results: Sequence[list[Hypothesis]], request_id: str,
                       decode: Decode) -> Any:
    """A TranslateResponse: one Translation per input, its hypotheses in order."""
    return pb2.TranslateResponse(
        request_id=request_id,
        translations=[pb2.Translation(hypotheses=[hypothesis(h, decode) for h in hypotheses])
                      for hypotheses in results])


def stream_response(chunk: Chunk, request_id: str, decode: Decode) -> Any:
    """A TranslateStreamResponse for one chunk; the last of an input carries its final
    hypothesis (and every hypothesis, when there are several)."""
    if not chunk.done:
        return pb2.TranslateStreamResponse(index=chunk.index, request_id=request_id,
                                           text_delta=chunk.text_delta,
                                           token_ids=chunk.token_ids)
    assert chunk.final is not None
    message = pb2.TranslateStreamResponse(
        index=chunk.index, request_id=request_id, done=True, text_delta=chunk.text_delta,
        token_ids=chunk.token_ids, final=hypothesis(chunk.final, decode, chunk.final_text))
    if chunk.hypotheses:
        message.hypotheses.extend(hypothesis(h, decode) for h in chunk.hypotheses)
    return message


def encode_response(results: Sequence[Any], request_id: str) -> Any:
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


def list_models_response(statuses: Sequence[ModelStatus], default_model: str) -> Any:
    """A ListModelsResponse: every model of the repository with its state."""
    return pb2.ListModelsResponse(default_model=default_model, models=[pb2.ModelStatus(
        name=status.name, state=pb2.ModelState.Value(f"MODEL_STATE_{status.state.upper()}"),
        version=status.version, loaded_version=status.loaded_version,
        model_name=status.model_name, source_language=status.source_language,
        target_language=status.target_language, memory_bytes=status.memory_bytes,
        in_flight=status.in_flight, last_error=status.last_error,
        is_default=status.is_default) for status in statuses])


# -- the JSON mapping -----------------------------------------------------------------------


def from_json(body: bytes, message_class: Any) -> Any:
    """A request message from its JSON mapping (lowerCamelCase or proto field names), or
    InvalidArgument saying what is wrong: not JSON, not an object, an unknown field, a value
    of the wrong type (json_format names the field)."""
    name = message_class.DESCRIPTOR.name
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidArgument(f"the request body must be a JSON object (a {name}), "
                              f"not {type(document).__name__}")
    try:
        return json_format.ParseDict(document, message_class())
    except (json_format.ParseError, RecursionError) as exc:
        # json_format's messages name the field (and may run over several lines)
        raise InvalidArgument(f"the request body is not a valid {name}: "
                              f"{' '.join(str(exc).split())}") from None


def to_dict(message: Any) -> dict[str, Any]:
    """A message as its JSON mapping: lowerCamelCase names, int64 as strings, fields at
    their default left out."""
    return json_format.MessageToDict(message)


def to_json(message: Any) -> bytes:
    """A message as compact JSON (UTF-8)."""
    return json.dumps(to_dict(message), ensure_ascii=False,
                      separators=(",", ":")).encode("utf-8")
