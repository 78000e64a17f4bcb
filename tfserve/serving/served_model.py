"""What the serving core needs of a model it serves (`ServedModel`): the Backend its scheduler
runs, and what the request checks and the model's description read. tfserve.runtime.Runtime
(the ONNX Runtime sessions) is one; anything with the same attributes serves as well (a
test's runtime with its model runs observed, say)."""

from __future__ import annotations

from typing import Any, Protocol

from tfserve.artifacts.manifest import Manifest
from tfserve.artifacts.model_config import ModelConfig
from tfserve.generation import Backend
from tfserve.text.tokenizer import Tokenizer


class ServedModel(Backend, Protocol):
    """A Backend with its tokenizer, config and manifest (model.json), served by the core.

    Optional, not declared here: `directory`, the artifacts directory it was loaded from
    (names and versions a model given to the server without --model)."""

    tokenizer: Tokenizer
    config: ModelConfig
    manifest: Manifest
    max_source_positions: int

    def describe(self) -> dict[str, Any]:
        """How it runs: device, providers, and what else the serving log and ModelInfo
        show (kv_cache, pack_weights)."""
