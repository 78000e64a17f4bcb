"""The generated gRPC stubs of proto/tfserve/v1, built on first use.

    from tfserve.proto import translator_pb2, translator_pb2_grpc

The modules themselves live in tfserve/proto/tfserve/v1/ and are not committed: the first
import generates them with `tfserve.proto_build` (grpcio-tools) when they are missing or were
generated from other .proto sources. `python -m tfserve.proto_build` does the same explicitly.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

_MODULES = ("translator_pb2", "translator_pb2_grpc")
_lock = threading.Lock()
_checked = False


def ensure_generated() -> None:
    """Generate the stubs if they are missing or stale (once per process)."""
    global _checked
    if _checked:
        return
    with _lock:
        if _checked:
            return
        from tfserve import proto_build

        if proto_build.is_stale():
            proto_build.build()
            importlib.invalidate_caches()
        _checked = True


def load() -> tuple[ModuleType, ModuleType]:
    """(translator_pb2, translator_pb2_grpc), generated first when needed."""
    ensure_generated()
    pb2 = importlib.import_module("tfserve.proto.tfserve.v1.translator_pb2")
    pb2_grpc = importlib.import_module("tfserve.proto.tfserve.v1.translator_pb2_grpc")
    return pb2, pb2_grpc


def __getattr__(name: str) -> ModuleType:
    if name in _MODULES:
        pb2, pb2_grpc = load()
        return pb2 if name == "translator_pb2" else pb2_grpc
    raise AttributeError(f"module 'tfserve.proto' has no attribute {name!r}")
