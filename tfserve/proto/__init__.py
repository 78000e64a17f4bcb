"""The gRPC stubs of proto/, generated when tfserve is built.

    from tfserve.proto import translator_pb2, translator_pb2_grpc   # tfserve.v1
    pb2, pb2_grpc = load_inference()    # the Open Inference Protocol (proto/inference)

The modules live in tfserve/proto/tfserve/v1/ and tfserve/proto/inference/. Wheels and
sdists ship them and an editable install generates them into the source tree (the build
hooks in tfserve/proto/build.py); importing them only imports, so an installed tfserve never
writes to its own directory and never needs grpcio-tools. After a .proto change in a source
checkout, `python -m tfserve.proto.build` regenerates them.

A wheel's modules come from the grpcio-tools pinned in pyproject.toml's [build-system]: they
import on protobuf 5.29.0 and later (5.x, 6.x, 7.x) and grpcio 1.71.2 and later, the floors
of tfserve's dependencies.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_PACKAGE = "tfserve.proto.tfserve.v1"
_MODULES = ("translator_pb2", "translator_pb2_grpc")

MISSING = (
    "the gRPC stubs of tfserve ({package}) are missing from {where}: they are generated when "
    "tfserve is built, so reinstall it (pip install --force-reinstall tfserve, or pip install "
    "-e . in a source checkout), or generate them in a source checkout with "
    "`python -m tfserve.proto.build` (grpcio-tools, in the dev extra)"
)


class StubsMissingError(ImportError):
    """The generated modules are not installed (a build without its stubs)."""


def load() -> tuple[ModuleType, ModuleType]:
    """(translator_pb2, translator_pb2_grpc), the shipped generated modules."""
    return _load(_PACKAGE, "translator")


def load_inference() -> tuple[ModuleType, ModuleType]:
    """(grpc_service_pb2, grpc_service_pb2_grpc): the Open Inference Protocol's messages
    (in tfserve.proto.private_pool's descriptor pool) and service."""
    return _load("tfserve.proto.inference", "grpc_service")


def _load(package: str, name: str) -> tuple[ModuleType, ModuleType]:
    try:
        pb2 = importlib.import_module(f"{package}.{name}_pb2")
        pb2_grpc = importlib.import_module(f"{package}.{name}_pb2_grpc")
    except ModuleNotFoundError as exc:
        # only our own generated modules (or their packages) count as missing stubs; a
        # missing dependency (grpc, google.protobuf) keeps its own error
        missing = exc.name or ""
        if not (missing.startswith(package) or package.startswith(missing + ".")):
            raise
        raise StubsMissingError(
            MISSING.format(package=package, where=__path__[0]), name=exc.name) from exc
    return pb2, pb2_grpc


def __getattr__(name: str) -> ModuleType:
    if name in _MODULES:
        pb2, pb2_grpc = load()
        return pb2 if name == "translator_pb2" else pb2_grpc
    raise AttributeError(f"module 'tfserve.proto' has no attribute {name!r}")
