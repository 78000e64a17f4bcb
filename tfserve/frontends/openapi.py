"""The OpenAPI 3 document of the HTTP API (`GET /openapi.json`), built from the same route
table that builds the aiohttp app (tfserve.frontends.http_api) and from the descriptors of the
`tfserve.v1` messages: the schemas follow protobuf's JSON mapping (lowerCamelCase names,
64-bit integers as strings), so nothing here restates a field by hand.

The request messages' schemas carry the limits every model of the server shares (`input_limits`:
the server's settings, the decoding options' bounds), each taken from where its check declares
it. A model's own limits (its vocabulary, source and target length, languages) and the rules
between fields (min_new_tokens <= max_new_tokens, num_return_sequences <= num_beams, one
target prefix per text) are not JSON schema: the server answers them 400 naming the field.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tfserve import option_table
from tfserve.frontends.messages import is_repeated, pb2
from tfserve.serving.requests import MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN
from tfserve.serving.settings import ServerConfig
from tfserve.serving.status import Status
from tfserve.text.documents import FORMATS
from tfserve.text.inputs import POOLINGS
from tfserve.text.translation_inputs import MAX_PREFIX_CHARS
from tfserve.version import __version__

# scalar field types -> their JSON mapping's schema
_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number", "format": "float"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int64", "minimum": 0},
    # 64-bit integers are JSON strings in the mapping (numbers are accepted on input)
    FieldDescriptor.TYPE_INT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_SINT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_UINT64: {"type": "string", "format": "uint64"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
}

_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)
# the JSON mapping writes a float that is not finite as one of these strings
_NOT_FINITE = {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["code", "message"],
        "properties": {
            "code": {"type": "string", "enum": [status.name for status in Status
                                                if status != Status.OK]},
            "message": {"type": "string"},
        },
    }},
}


@dataclass(frozen=True)
class Operation:
    """One documented route: its method and path, what it does, the message it takes in its
    JSON body (None: no body), what it answers (a message name, `answer`: the schema of a
    JSON answer that is no message, or `content` for another media type), whether it needs
    the bearer token, whether it is a call (it takes the call headers), and the statuses it
    may answer besides 200."""

    method: str
    path: str
    summary: str
    request: str | None = None
    response: str | None = None
    content: str = "application/json"  # of the answer, when `response` is not a message
    secured: bool = True
    errors: tuple[int, ...] = ()
    answer: Mapping[str, Any] | None = None
    call: bool = False


@dataclass(frozen=True)
class Header:
    """A request header the calls take: its name, its value's schema (the limits of the
    check that reads it) and what it does."""

    name: str
    schema: Mapping[str, Any]
    description: str


def counting_pattern(limit: int) -> str:
    """A regular expression of the decimal numerals of 1 to `limit` (leading zeros allowed,
    as int() reads them): a header is text, and its schema says the range exactly."""
    digits = str(limit)
    shorter = f"[1-9][0-9]{{0,{len(digits) - 2}}}" if len(digits) > 1 else None
    same = []  # as long as `limit`: equal to it up to a place, then a smaller digit there
    for place, digit in enumerate(digits):
        low = 1 if place == 0 else 0
        if int(digit) > low:
            rest = len(digits) - place - 1
            same.append(f"{digits[:place]}[{low}-{int(digit) - 1}]"
                        + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives = [shorter] if shorter else []
    return f"^0*(?:{'|'.join([*alternatives, *same, digits])})$"


# the id a client gives a call (header x-request-id, or a body's requestId): its check's rule
REQUEST_ID_SCHEMA = {"type": "string", "maxLength": MAX_REQUEST_ID_CHARS,
                     "pattern": REQUEST_ID_PATTERN}


def input_limits(config: ServerConfig) -> dict[str, dict[str, Any]]:
    """The request messages' schemas beyond their proto types, by message: `properties`
    (keywords added to a field's schema; `items` to a repeated field's items) and keywords
    of the message's own (which fields it requires). Every limit here holds for every model
    of a server with `config`, and comes from where its check declares it."""
    text = {"pattern": r"\S"}  # not blank
    texts = {"maxItems": config.max_texts_per_request, "items": text}
    return {
        "TranslateRequest": {
            "properties": {"texts": texts, "requestId": REQUEST_ID_SCHEMA,
                           "tokenIds": {"maxItems": config.max_texts_per_request},
                           "targetPrefix": {"maxItems": config.max_texts_per_request,
                                            "items": {"maxLength": MAX_PREFIX_CHARS}},
                           "format": {"enum": ["", *FORMATS, None]}},
            # texts or token_ids: one of them, not empty
            "anyOf": [{"required": ["texts"], "properties": {
                           "texts": {"type": "array", "minItems": 1},
                           "tokenIds": {"maxItems": 0}}},
                      {"required": ["tokenIds"], "properties": {
                           "tokenIds": {"type": "array", "minItems": 1},
                           "texts": {"maxItems": 0}}}],
        },
        "EncodeRequest": {
            "properties": {"texts": {**texts, "minItems": 1}, "requestId": REQUEST_ID_SCHEMA,
                           "pooling": {"enum": ["", *POOLINGS, None]}},
            "required": ["texts"],
        },
        "DetectRequest": {
            "properties": {"texts": {**texts, "minItems": 1, "items": {
                               **text, "maxLength": config.max_document_characters}},
                           "requestId": REQUEST_ID_SCHEMA},
            "required": ["texts"],
        },
        "TokenIds": {"properties": {"ids": {"minItems": 1, "items": {
            "type": "integer", "minimum": 0, "format": "int64"}}}, "required": ["ids"]},
        "DecodingOptions": {"properties": option_schemas(config)},
    }


_INT64 = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_UINT64)


def option_schemas(config: ServerConfig) -> dict[str, dict[str, Any]]:
    """The keywords each declared decoding option (tfserve.option_table) adds to its
    field's schema, by JSON name: its limits (0 is allowed too where it means "the default":
    a field without presence), bounded by --max-batch-size too for a count of batch rows;
    its label (title) and help with range and default (description); and for the
    playground, which builds its controls from them: x-tfserve-searches (the searches that
    read it), x-tfserve-default (the value the server takes where neither the request nor
    the model sets one: not JSON schema's `default`, which would be the value of every
    request that leaves it out), x-tfserve-off (true where that default turns the option
    off) and x-tfserve-example (a typical value)."""
    descriptor = pb2.DecodingOptions.DESCRIPTOR
    schemas: dict[str, dict[str, Any]] = {}
    for declared in option_table.OPTIONS:
        found = descriptor.fields_by_name[declared.name]
        schema: dict[str, Any] = {"title": declared.label,
                                  "description": declared.description,
                                  "x-tfserve-searches": list(declared.searches)}
        for keyword, value in (("x-tfserve-default", declared.default),
                               ("x-tfserve-example", declared.example)):
            if value is not None:
                schema[keyword] = value
        if declared.off:
            schema["x-tfserve-off"] = True
        if declared.low is not None:
            zero_is_default = not found.has_presence and declared.low > 0
            schema["minimum"] = 0 if zero_is_default else declared.low
            if declared.low_open and not zero_is_default:
                schema["exclusiveMinimum"] = True
            if found.type in _INT64:  # bounds a number, not the mapping's string
                schema["type"] = "integer"
        if declared.high is not None:
            schema["maximum"] = (min(declared.high, config.max_batch_size)
                                 if declared.batch_rows else declared.high)
        schemas[found.json_name] = schema
    return schemas


def message_schemas(names: Iterable[str],
                    limits: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """JSON schemas of the named messages of tfserve.v1 and every message they hold, with
    `limits` (input_limits) merged into the messages it names: those are what a client
    sends, so a field the schema does not name is refused there, as the server refuses it,
    and a field may be null (the JSON mapping reads it as the field's default) unless the
    message requires it."""
    limits = limits or {}
    schemas: dict[str, Any] = {}
    pending = [pb2.DESCRIPTOR.message_types_by_name[name] for name in names]
    while pending:
        descriptor: Descriptor = pending.pop()
        if descriptor.name in schemas:
            continue
        extra = copy.deepcopy(dict(limits.get(descriptor.name, {})))
        added = extra.pop("properties", {})
        properties = {}
        for field in descriptor.fields:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                schema: dict[str, Any] = {"$ref": f"#/components/schemas/"
                                                  f"{field.message_type.name}"}
                pending.append(field.message_type)
            elif field.type == FieldDescriptor.TYPE_ENUM:  # the value's name, as a string
                schema = {"type": "string",
                          "enum": [value.name for value in field.enum_type.values]}
            elif field.type in _FLOATS and descriptor.name not in limits:
                schema = {"anyOf": [_SCALARS[field.type], _NOT_FINITE]}
            else:
                schema = dict(_SCALARS[field.type])
            more = dict(added.get(field.json_name, {}))
            if is_repeated(field):
                schema = {"type": "array", "items": {**schema, **more.pop("items", {})}}
            schema = {**schema, **more}
            if descriptor.name in limits and field.json_name not in extra.get("required", ()):
                if "$ref" in schema:  # OpenAPI 3.0 reads no keyword beside a $ref
                    schema = {"allOf": [schema]}
                schema["nullable"] = True
            properties[field.json_name] = schema
        schemas[descriptor.name] = {
            "type": "object", "properties": properties, **extra,
            "description": f"tfserve.v1.{descriptor.name} in protobuf's JSON mapping (proto "
                           "field names are accepted too)"}
        if descriptor.name in limits:
            schemas[descriptor.name]["additionalProperties"] = False
    return schemas


_REASONS = {400: "Bad request or bad header (INVALID_ARGUMENT: the message names the field)",
            401: "Missing or wrong bearer token",
            404: "No such model (NOT_FOUND; the message names the models served)",
            413: "Request body over --max-message-bytes",
            429: "Queue full, or the answer over --max-message-bytes (RESOURCE_EXHAUSTED)",
            500: "Internal error", 503: "Shutting down, or not ready yet (UNAVAILABLE)",
            504: "The x-request-timeout-ms deadline passed (DEADLINE_EXCEEDED)"}


_PATH_PARAMETER = re.compile(r"\{(\w+)\}")  # /v1/models/{name}


def _operation(operation: Operation, headers: Sequence[Header]) -> dict[str, Any]:
    """The OpenAPI operation object of one route."""
    ok: dict[str, Any] = {"description": "OK"}
    if operation.response is not None and operation.content == "application/json":
        ok["content"] = {"application/json": {"schema": {
            "$ref": f"#/components/schemas/{operation.response}"}}}
    elif operation.content == "text/event-stream":  # the schema of one event (OpenAPI 3.0)
        ok["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "properties": {
                "event": {"type": "string", "enum": ["message", "done", "error"]},
                "data": {"type": "string"}}}}}
        ok["description"] = (f"Server-sent events: `data: <{operation.response} JSON>` per "
                             "chunk, then `event: done` (`data: {}`); a failure after the "
                             "first event is `event: error` with `data: <Error JSON>`")
    elif operation.answer is not None:
        ok["content"] = {operation.content: {"schema": dict(operation.answer)}}
    else:
        ok["content"] = {operation.content: {"schema": {"type": "string"}}}
    responses: dict[str, Any] = {"200": ok}
    errors = set(operation.errors) | ({400} if operation.call and headers else set())
    for code in sorted(errors):
        responses[str(code)] = {"description": _REASONS[code], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    body: dict[str, Any] = {"summary": operation.summary, "responses": responses}
    if operation.request is not None:
        body["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{operation.request}"}}}}
    if operation.call:
        body["parameters"] = [{"name": header.name, "in": "header", "required": False,
                               "schema": dict(header.schema),
                               "description": header.description} for header in headers]
    for name in _PATH_PARAMETER.findall(operation.path):
        body.setdefault("parameters", []).insert(0, {
            "name": name, "in": "path", "required": True, "schema": {"type": "string"},
            "description": "a model's name (GET /v1/models lists them)"})
    if not operation.secured:
        body["security"] = []
    return body


def openapi_document(operations: Iterable[Operation], config: ServerConfig,
                     headers: Sequence[Header] = ()) -> dict[str, Any]:
    """The OpenAPI 3.0 document of `operations` on a server with `config` (its bearer token,
    its limits); `headers`: the request headers every call takes."""
    operations = list(operations)
    paths: dict[str, dict[str, Any]] = {}
    for operation in operations:
        paths.setdefault(operation.path, {})[operation.method.lower()] = _operation(
            operation, headers)
    names = {name for operation in operations for name in (operation.request, operation.response)
             if name in pb2.DESCRIPTOR.message_types_by_name}
    document: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "tfserve HTTP API", "version": __version__,
                 "description": "tfserve.v1.Translator over HTTP/JSON: the messages of "
                                "proto/tfserve/v1/translator.proto in protobuf's JSON mapping"},
        "paths": paths,
        "components": {"schemas": {**message_schemas(sorted(names), input_limits(config)),
                                   "Error": ERROR_SCHEMA}},
    }
    if config.auth_token:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
