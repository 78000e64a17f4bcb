"""Fixtures the serving tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from server_helpers import demo_trained


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled demo, exported once a session into a cache of its own."""
    if not demo_trained():
        pytest.skip("the demo checkpoint (tfserve/demo/checkpoint/model.safetensors) is not "
                    "trained yet")
    from tfserve.demo import default_artifacts

    saved = os.environ.get("TFSERVE_CACHE")
    os.environ["TFSERVE_CACHE"] = str(tmp_path_factory.mktemp("tfserve-cache"))
    try:
        return default_artifacts()
    finally:
        if saved is None:
            os.environ.pop("TFSERVE_CACHE", None)
        else:
            os.environ["TFSERVE_CACHE"] = saved
