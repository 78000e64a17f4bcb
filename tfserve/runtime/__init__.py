"""ONNX Runtime over an artifacts directory: the serving backend of the search.

Imports numpy and onnxruntime only (never torch), so the serving image carries no PyTorch.

`Runtime` (`tfserve.runtime.sessions`) loads model.json, the two graphs and the tokenizer,
creates one InferenceSession per graph on the requested device (`cpu`, `cuda`, `cuda:N`:
the table in `tfserve.runtime.providers`) with the given options, and implements
`tfserve.generation.Backend`: encode, one decoder step, and the cache row operations the
continuous-batching loop needs.

On CPU the cache is a list of numpy arrays [k_0, v_0, k_1, v_1, ...], each [B,H,P,Dh]
(`HostCache`). On CUDA (or with device_cache=True) each step is run with IO binding: the cross
and present K/V stay in device memory as OrtValues and are bound as the next step's inputs,
so a step moves only token ids, masks and logits between host and device; row operations
(beam reorder, rows joining or leaving) run on the device too (`DeviceCache`, with the graphs
of `tfserve.runtime.cache_graphs`).
"""

from tfserve.runtime.cache import POOL_MIN_BYTES, CacheStorage, DeviceCache, HostCache
from tfserve.runtime.providers import (
    OPTIMIZATION_LEVELS,
    PROVIDERS,
    SHARED_ARENA_INITIAL_BYTES,
    Provider,
    ProviderError,
    default_threads,
    make_session,
    parse_device,
    provider_list,
    share_cpu_arena,
)
from tfserve.runtime.sessions import Runtime

__all__ = [
    "OPTIMIZATION_LEVELS",
    "POOL_MIN_BYTES",
    "PROVIDERS",
    "SHARED_ARENA_INITIAL_BYTES",
    "CacheStorage",
    "DeviceCache",
    "HostCache",
    "Provider",
    "ProviderError",
    "Runtime",
    "default_threads",
    "make_session",
    "parse_device",
    "provider_list",
    "share_cpu_arena",
]
