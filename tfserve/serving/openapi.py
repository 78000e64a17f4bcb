"""The OpenAPI 3 document of the HTTP API (`GET /openapi.json`), built from the same route
table that builds the aiohttp app (tfserve.serving.http_api) and from the descriptors of the
`tfserve.v1` messages: the schemas follow protobuf's JSON mapping (lowerCamelCase names,
64-bit integers as strings), so nothing here restates a field by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tfserve.serving.messages import pb2
from tfserve.serving.status import Status
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
    JSON body (None: no body), what it answers (a message name, or `content` for another
    media type), whether it needs the bearer token, and the statuses it may answer."""

    method: str
    path: str
    summary: str
    request: str | None = None
    response: str | None = None
    content: str = "application/json"  # of the answer, when `response` is not a message
    secured: bool = True
    errors: tuple[int, ...] = ()


def message_schemas(names: Iterable[str]) -> dict[str, Any]:
    """JSON schemas of the named messages of tfserve.v1 and every message they hold."""
    schemas: dict[str, Any] = {}
    pending = [pb2.DESCRIPTOR.message_types_by_name[name] for name in names]
    while pending:
        descriptor: Descriptor = pending.pop()
        if descriptor.name in schemas:
            continue
        properties = {}
        for field in descriptor.fields:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                schema: dict[str, Any] = {"$ref": f"#/components/schemas/"
                                                  f"{field.message_type.name}"}
                pending.append(field.message_type)
            elif field.type == FieldDescriptor.TYPE_ENUM:  # the value's name, as a string
                schema = {"type": "string",
                          "enum": [value.name for value in field.enum_type.values]}
            else:
                schema = dict(_SCALARS[field.type])
            if field.is_repeated:
                schema = {"type": "array", "items": schema}
            properties[field.json_name] = schema
        schemas[descriptor.name] = {"type": "object", "properties": properties,
                                    "description": f"tfserve.v1.{descriptor.name} in "
                                                   "protobuf's JSON mapping (proto field "
                                                   "names are accepted too)"}
    return schemas


_REASONS = {400: "Bad request (INVALID_ARGUMENT)", 401: "Missing or wrong bearer token",
            404: "No such model (NOT_FOUND; the message names the models served)",
            413: "Request body over --max-message-bytes",
            429: "Queue full, or the answer over --max-message-bytes (RESOURCE_EXHAUSTED)",
            500: "Internal error", 503: "Shutting down, or not ready yet (UNAVAILABLE)",
            504: "The x-request-timeout-ms deadline passed (DEADLINE_EXCEEDED)"}


_PATH_PARAMETER = re.compile(r"\{(\w+)\}")  # /v1/models/{name}


def _operation(operation: Operation) -> dict[str, Any]:
    """The OpenAPI operation object of one route."""
    ok: dict[str, Any] = {"description": "OK"}
    if operation.response is not None and operation.content == "application/json":
        ok["content"] = {"application/json": {"schema": {
            "$ref": f"#/components/schemas/{operation.response}"}}}
    elif operation.content == "text/event-stream":
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
        ok["description"] = (f"Server-sent events: `data: <{operation.response} JSON>` per "
                             "chunk, then `event: done` (`data: {}`); a failure after the "
                             "first event is `event: error` with `data: <Error JSON>`")
    else:
        ok["content"] = {operation.content: {"schema": {"type": "string"}}}
    responses: dict[str, Any] = {"200": ok}
    for code in operation.errors:
        responses[str(code)] = {"description": _REASONS[code], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    body: dict[str, Any] = {"summary": operation.summary, "responses": responses}
    if operation.request is not None:
        body["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{operation.request}"}}}}
    if operation.request is not None or operation.response in pb2.DESCRIPTOR.message_types_by_name:
        body["parameters"] = [
            {"name": "x-request-id", "in": "header", "required": False,
             "schema": {"type": "string", "maxLength": 128},
             "description": "the request's id, unless its body has request_id; echoed back"},
            {"name": "x-request-timeout-ms", "in": "header", "required": False,
             "schema": {"type": "integer", "minimum": 1},
             "description": "deadline in milliseconds: DEADLINE_EXCEEDED (504) once it passes"},
        ]
    for name in _PATH_PARAMETER.findall(operation.path):
        body.setdefault("parameters", []).insert(0, {
            "name": name, "in": "path", "required": True, "schema": {"type": "string"},
            "description": "a model's name (GET /v1/models lists them)"})
    if not operation.secured:
        body["security"] = []
    return body


def openapi_document(operations: Iterable[Operation], auth: bool) -> dict[str, Any]:
    """The OpenAPI 3.0 document of `operations`; `auth`: the server wants a bearer token."""
    operations = list(operations)
    paths: dict[str, dict[str, Any]] = {}
    for operation in operations:
        paths.setdefault(operation.path, {})[operation.method.lower()] = _operation(operation)
    names = {name for operation in operations for name in (operation.request, operation.response)
             if name in pb2.DESCRIPTOR.message_types_by_name}
    document: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "tfserve HTTP API", "version": __version__,
                 "description": "tfserve.v1.Translator over HTTP/JSON: the messages of "
                                "proto/tfserve/v1/translator.proto in protobuf's JSON mapping"},
        "paths": paths,
        "components": {"schemas": {**message_schemas(sorted(names)), "Error": ERROR_SCHEMA}},
    }
    if auth:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
