"""The fields of a SentencePiece model file (`ModelProto`, sentencepiece_model.proto) that
tfserve reads, as protobuf messages of its own.

sentencepiece's generated module (`sentencepiece.sentencepiece_model_pb2`) refuses protobuf
runtimes older than the one it was generated with (0.2.3: protobuf 7.36.1), so it cannot load
beside packages that hold protobuf below 7 (tritonclient, kserve). These messages are built
from a descriptor at import, in a pool of their own, which every protobuf runtime tfserve
supports parses alike. They declare a subset of ModelProto's fields, with the file's field
numbers, types and defaults; the others stay unknown fields, kept when a model is parsed and
written again.

    model = parse_model(path.read_bytes())
    [(piece.piece, piece.score, piece.type) for piece in model.pieces]
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

# sentencepiece_model.proto: ModelProto.SentencePiece.Type and TrainerSpec.ModelType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
UNIGRAM = 1

_FieldType = descriptor_pb2.FieldDescriptorProto
# (message, [(field name, number, type, label, message type or default)])
_MESSAGES = (
    ("ModelProto", [
        ("pieces", 1, _FieldType.TYPE_MESSAGE, _FieldType.LABEL_REPEATED, "SentencePiece"),
        ("trainer_spec", 2, _FieldType.TYPE_MESSAGE, _FieldType.LABEL_OPTIONAL, "TrainerSpec"),
        ("normalizer_spec", 3, _FieldType.TYPE_MESSAGE, _FieldType.LABEL_OPTIONAL,
         "NormalizerSpec"),
    ]),
    # the enums as int32 with the enum's default: the same varint on the wire
    ("SentencePiece", [
        ("piece", 1, _FieldType.TYPE_STRING, _FieldType.LABEL_OPTIONAL, None),
        ("score", 2, _FieldType.TYPE_FLOAT, _FieldType.LABEL_OPTIONAL, None),
        ("type", 3, _FieldType.TYPE_INT32, _FieldType.LABEL_OPTIONAL, str(NORMAL)),
    ]),
    ("TrainerSpec", [
        ("model_type", 3, _FieldType.TYPE_INT32, _FieldType.LABEL_OPTIONAL, str(UNIGRAM)),
        ("unk_id", 40, _FieldType.TYPE_INT32, _FieldType.LABEL_OPTIONAL, "0"),
        ("eos_piece", 46, _FieldType.TYPE_STRING, _FieldType.LABEL_OPTIONAL, "</s>"),
    ]),
    ("NormalizerSpec", [
        ("precompiled_charsmap", 2, _FieldType.TYPE_BYTES, _FieldType.LABEL_OPTIONAL, None),
    ]),
)
_PACKAGE = "tfserve.spiece"


def _model_class() -> Any:
    """The ModelProto message class, from a proto2 file descriptor of the fields above."""
    file = descriptor_pb2.FileDescriptorProto(name="tfserve/spiece_model.proto",
                                              package=_PACKAGE, syntax="proto2")
    for name, fields in _MESSAGES:
        message = file.message_type.add(name=name)
        for field_name, number, kind, label, extra in fields:
            field = message.field.add(name=field_name, number=number, type=kind, label=label)
            if kind == _FieldType.TYPE_MESSAGE:
                field.type_name = f".{_PACKAGE}.{extra}"
            elif extra is not None:
                field.default_value = extra
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.ModelProto"))


ModelProto = _model_class()


def parse_model(data: bytes) -> Any:
    """The ModelProto of a SentencePiece model file's bytes (protobuf's DecodeError when they
    are not one)."""
    model = ModelProto()
    model.ParseFromString(data)
    return model
