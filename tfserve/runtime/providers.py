"""Devices as ONNX Runtime execution providers, and the InferenceSessions made on them.

`PROVIDERS` is the one table of devices: `parse_device` accepts its names (and `name:N` where
an entry takes an index), `make_session` builds the provider list from it and refuses a
device whose provider this onnxruntime lacks or could not create. Another execution
provider is one more entry, for example TensorRT:
`Provider("tensorrt", "TensorrtExecutionProvider", "TensorRT", _device_id, indexed=True,
fallbacks=("cuda", "cpu"), memory="cuda", ...)`, or OpenVINO with options
`{"device_type": "GPU"}` and memory "cpu".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort

from tfserve.runtime.step_graph import EXTERNAL_DATA_FOLDER

SHARED_ARENA_INITIAL_BYTES = 512 << 20  # address space reserved up front; RSS only when used
_shared_arena_lock = threading.Lock()
_shared_arena_registered = False

OPTIMIZATION_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class ProviderError(RuntimeError):
    """The device's execution provider is missing from this onnxruntime or failed to start."""


@dataclass(frozen=True)
class Provider:
    """How one device name becomes an ONNX Runtime execution provider."""

    name: str  # the device as written: "cpu", "cuda" (and "cuda:N" where indexed)
    ort_name: str  # ONNX Runtime's provider name
    label: str  # the provider in messages: "the CUDA execution provider"
    options: Callable[[int], dict[str, Any]]  # device index -> provider options
    indexed: bool = False  # whether "name:N" picks device N (passed through `options`)
    # devices tried after this one, by name in this table, for the nodes it cannot run
    fallbacks: tuple[str, ...] = ()
    memory: str = "cpu"  # where its tensors live: the OrtValue / IO-binding device name
    cache_on_device: bool = False  # default of Runtime's device_cache
    # Runtime's kv_cache "auto": the static KV cache (buffers written in place, which a
    # captured graph can replay) rather than a cache tensor per step. Off on CPU, where the
    # dynamic one is faster (docs/benchmarks.md); off on CUDA until measured on a GPU
    static_cache: bool = False
    cpu_arena: bool = False  # allocates from the process's shared CPU arena when asked
    # for the errors: what the provider needs installed, how to get it, what it needs to run
    requirement: str = "onnxruntime"
    install: str = "pip install onnxruntime"
    needs: str = ""


def _no_options(index: int) -> dict[str, Any]:
    return {}


def _device_id(index: int) -> dict[str, Any]:
    return {"device_id": index}


PROVIDERS: dict[str, Provider] = {
    provider.name: provider
    for provider in (
        Provider("cpu", "CPUExecutionProvider", "CPU", _no_options, cpu_arena=True),
        Provider("cuda", "CUDAExecutionProvider", "CUDA", _device_id, indexed=True,
                 fallbacks=("cpu",), memory="cuda", cache_on_device=True,
                 requirement="onnxruntime-gpu with the CUDA execution provider",
                 install="pip install 'tfserve[gpu]'",
                 needs="CUDA/cuDNN libraries matching onnxruntime-gpu, a driver and a visible "
                       "GPU are needed"),
    )
}


def _device_forms() -> str:
    """The accepted spellings, for messages: 'cpu', 'cuda' or 'cuda:N'."""
    forms = [f"'{name}'" for name in PROVIDERS]
    forms += [f"'{name}:N'" for name, provider in PROVIDERS.items() if provider.indexed]
    return ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else forms[0]


def parse_device(device: str) -> tuple[str, int]:
    """'cpu' | 'cuda' | 'cuda:N' (the names in PROVIDERS) -> (name, index); ValueError naming
    the field and the known devices otherwise."""
    text = device.strip().lower()
    name, colon, index = text.partition(":")
    provider = PROVIDERS.get(name)
    if provider is not None:
        if not colon:
            return name, 0
        if provider.indexed and index.isdigit():
            return name, int(index)
    raise ValueError(f"device must be {_device_forms()}, got {device!r}")


def provider_list(name: str, index: int) -> list[Any]:
    """The `providers` argument of an InferenceSession for device `name` (index N): the
    device's provider with its options, then its fallbacks; a provider without options is
    given by name alone."""
    entries: list[Any] = []
    for device in (name, *PROVIDERS[name].fallbacks):
        provider = PROVIDERS[device]
        options = provider.options(index)
        entries.append((provider.ort_name, options) if options else provider.ort_name)
    return entries


def make_session(
    path: str | Path,
    device: str = "cpu",
    intra_op_threads: int = 0,
    inter_op_threads: int = 0,
    optimization: str = "all",
    allow_spinning: bool = False,
    shared_arena: bool = True,
    initializers: Mapping[str, ort.OrtValue] | None = None,
    model: bytes | None = None,
) -> ort.InferenceSession:
    """One InferenceSession with explicit threads and optimization level.

    0 threads lets ONNX Runtime choose (one per physical core). allow_spinning lets idle pool
    threads busy-wait: faster only when nothing else needs the cores between runs.
    shared_arena (CPU): allocate from one process-wide arena (`share_cpu_arena`) instead of
    one per session.
    initializers: tensors the session takes as they are instead of loading them from the
    graph's files (`SessionOptions.add_initializer`), by initializer name: one OrtValue given
    to several sessions is one copy in memory (`tfserve.runtime.shared_weights`). They must
    outlive the session.
    model: the graph as bytes (a rewrite of the file at `path`, `tfserve.runtime.step_graph`),
    its external data read from the files beside `path`.
    """
    kind, index = parse_device(device)
    provider = PROVIDERS[kind]
    if optimization not in OPTIMIZATION_LEVELS:
        raise ValueError(f"optimization must be one of {sorted(OPTIMIZATION_LEVELS)}, "
                         f"got {optimization!r}")
    for name, value in (("intra_op_threads", intra_op_threads),
                        ("inter_op_threads", inter_op_threads)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not allow_spinning:
        # idle intra-op threads otherwise spin-wait for the next op, and between two decoder
        # steps they burn the cores the search's numpy work and the gRPC loop need
        # (measured on 2 cores: beam4 x 32 +16%, demo single-text latency -27%)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if shared_arena and provider.cpu_arena:
        share_cpu_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    if model is not None:
        options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(Path(path).parent))
    # fatal only: every error of a run reaches the caller as an exception, which the server
    # logs as one record (ONNX Runtime's own line on stderr would say it a second time)
    options.log_severity_level = 4
    available = ort.get_available_providers()
    if provider.ort_name not in available:
        raise ProviderError(
            f"device '{kind}' needs {provider.requirement}; this onnxruntime offers "
            f"{available} ({provider.install})"
        )
    session = ort.InferenceSession(str(path) if model is None else model,
                                   sess_options=options, providers=provider_list(kind, index))
    if provider.ort_name not in session.get_providers():
        # onnxruntime falls back to the next provider with only a warning when the device's
        # libraries or driver are missing: a server asked for a GPU must not quietly serve
        # from the CPU
        raise ProviderError(f"device '{kind}': ONNX Runtime could not create the "
                            f"{provider.label} execution provider ({provider.needs}); the "
                            f"session got {session.get_providers()}")
    return session


def share_cpu_arena() -> None:
    """Register one CPU memory arena for every session of this process that opts in (once).

    By default each session has its own arena, which keeps the high-water mark of its own
    peak: the encoder's activations and the decoder's caches never reuse each other's memory.
    One shared arena, created with one initial region large enough for a batch's working set
    rather than regions doubling as it grows (where fragments pile up), lowered the peak RSS
    of the opus-mt-base-sized model over the compare cases from 667 to 616 MiB (fp32) and
    from 438 to 434 MiB (int8), at the same speed (256 MiB initial: 633 / 443; each the same
    in repeated runs). The region is address space: only the pages used count in the RSS.
    """
    global _shared_arena_registered
    with _shared_arena_lock:
        if _shared_arena_registered:
            return
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                   ort.OrtMemType.DEFAULT)
        # (max_mem 0: no limit, extend strategy 0: next power of two, initial chunk,
        #  max_dead_bytes_per_chunk -1: the default)
        config = ort.OrtArenaCfg(0, 0, SHARED_ARENA_INITIAL_BYTES, -1)
        ort.create_and_register_allocator(memory, config)
        _shared_arena_registered = True


def default_threads() -> int:
    """Intra-op threads when none are given: the cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
