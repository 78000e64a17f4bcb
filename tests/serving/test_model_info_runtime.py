"""What ModelInfo says of how the runtime holds the model: the KV cache (--kv-cache) and the
pre-packed output projection (--pack-weights)."""

from __future__ import annotations

import pytest
from exported import demo_artifacts

from tfserve.runtime import Runtime
from tfserve.serving.model_info import model_info
from tfserve.serving.settings import ServerConfig


@pytest.mark.parametrize("kv_cache, expected", [("auto", "dynamic"), ("dynamic", "dynamic"),
                                                ("static", "static")])
def test_model_info_names_the_kv_cache(kv_cache: str, expected: str) -> None:
    config = ServerConfig(kv_cache=kv_cache).validate()
    runtime = Runtime(demo_artifacts(), kv_cache=config.kv_cache,
                      pack_weights=config.pack_weights)
    info = model_info(runtime, config, 32)
    assert info.kv_cache == expected
    assert info.packed_weights is True  # CPU pre-packs by default


def test_packed_weights_follow_the_setting() -> None:
    config = ServerConfig(pack_weights=False).validate()
    runtime = Runtime(demo_artifacts(), pack_weights=config.pack_weights)
    assert model_info(runtime, config, 32).packed_weights is False


def test_an_unknown_kv_cache_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--kv-cache must be one of auto, static, dynamic, "
                                         r"got 'fast'"):
        ServerConfig(kv_cache="fast").validate()
