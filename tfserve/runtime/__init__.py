"""ONNX Runtime over an artifacts directory: the serving backend of the search.

Imports numpy and onnxruntime only (never torch), so the serving image carries no PyTorch,
and nothing of `tfserve.generation`: it implements the step contract of `tfserve.step`.

`Runtime` (`tfserve.runtime.sessions`) loads model.json, the two graphs and the tokenizer,
creates one InferenceSession per graph on the requested device (`cpu`, `cuda`, `cuda:N`:
the table in `tfserve.runtime.providers`) with the given options, and implements
`tfserve.step.Backend`: encode, one decoder step, and the cache row operations the
continuous-batching loop needs. Where the KV cache lives between steps is one of three
placements, each honouring the step's beam parents and draws its own way:

- `HostCache` (`cache`): numpy arrays [k_0, v_0, k_1, v_1, ...], each [B,H,P,Dh]; the
  default on CPU;
- `DeviceCache` (`device_cache`): OrtValues in the device's memory, run with IO binding, so a
  step moves only token ids, masks and the top candidates (or the draws); row operations run
  on the device as small graphs (`cache_graphs`), a beam reorder and the sampling draws
  inside the step's one run (`step_graph`, `sampling_graph`); the default on CUDA;
- `StaticCache` (`static_cache`, `static_buffers`, `static_step`): the device placement with
  fixed buffers per bucket written in place and each bucket's step bound once (what a
  captured CUDA graph replays; `kv_cache="static"`, `--kv-cache static`).

Every run is counted in one `RunCounters` (`ort_runs`: the counters, the small graphs'
sessions and the bound run they share).
"""

from tfserve.runtime.cache import POOL_MIN_BYTES, CacheStorage, HostCache
from tfserve.runtime.device_cache import DeviceCache
from tfserve.runtime.ort_runs import RunCounters
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
    "RunCounters",
    "Runtime",
    "default_threads",
    "make_session",
    "parse_device",
    "provider_list",
    "share_cpu_arena",
]
