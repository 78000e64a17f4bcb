"""Fixtures of the Hugging Face import tests (test_marian.py, test_t5.py, test_families.py).

Each of those modules builds its own `checkpoints` fixture (name -> (checkpoint directory,
transformers model, ...)); the fixtures here export, load and import them the same way for
every module, over the names in the module's EXPORTED (all its checkpoints when it has
none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def exported(request: pytest.FixtureRequest, checkpoints: dict[str, tuple[Any, ...]],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> artifacts directory written by `python -m export --from-hf`."""
    from hf_import_helpers import export_each

    names = getattr(request.module, "EXPORTED", tuple(checkpoints))
    return export_each({name: checkpoints[name][0] for name in names},
                       tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="module")
def runtimes(exported: dict[str, Path]) -> dict[str, Any]:
    """name -> a Runtime of the exported artifacts (one intra-op thread)."""
    from tfserve.runtime import Runtime

    return {name: Runtime(path, intra_op_threads=1) for name, path in exported.items()}


@pytest.fixture(scope="module")
def imported(checkpoints: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """name -> tfserve's eager model as the importer builds it."""
    from export.importers import import_hf

    return {name: import_hf(built[0]).model for name, built in checkpoints.items()}


@pytest.fixture(scope="module")
def hf_tokenizers(checkpoints: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """name -> transformers' AutoTokenizer on the checkpoint."""
    from hf_import_helpers import auto_tokenizer

    return {name: auto_tokenizer(built[0]) for name, built in checkpoints.items()}
