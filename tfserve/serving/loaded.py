"""One loaded version of a model (`LoadedModel`: its runtime, its own scheduler and the
submitter that checks requests against it), how a repository entry becomes one
(`runtime_loader`), and how an unloaded one gives its memory back (`release_freed_memory`).
tfserve.serving.repository decides when models load and unload.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tfserve.scheduler import Scheduler
from tfserve.serving.model_scan import Entry, single_entry
from tfserve.serving.requests import Submitter
from tfserve.serving.served_model import ServedModel
from tfserve.serving.settings import ServerConfig
from tfserve.telemetry.metrics import Metrics

Loader = Callable[[Entry], ServedModel]  # an entry -> its loaded model


class RuntimeLoader:
    """Loads an entry on ONNX Runtime with --device and --threads."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    def refusal(self, entry: Entry) -> str:
        """Why `entry` cannot load, known before loading it ("" when it may): its model.json
        cannot be read. The repository asks before making room for a load."""
        return entry.manifest_error

    def __call__(self, entry: Entry) -> ServedModel:
        if entry.manifest_error:
            raise ValueError(entry.manifest_error)
        return open_runtime(entry.path, self.config)


def open_runtime(path: Path, config: ServerConfig) -> ServedModel:
    """The artifacts in `path` on ONNX Runtime as the server's settings say: --device,
    --threads, --pack-weights, --kv-cache."""
    from tfserve.runtime import Runtime

    return Runtime(path, device=config.device, intra_op_threads=config.threads,
                   pack_weights=config.pack_weights, kv_cache=config.kv_cache)


def runtime_loader(config: ServerConfig) -> Loader:
    """Loads an entry on ONNX Runtime with --device and --threads (RuntimeLoader)."""
    return RuntimeLoader(config)


class LoadedModel:
    """One loaded version of a model: runtime, scheduler, submitter, requests in flight.

    `retired` says why this version no longer takes new requests ("replaced" by a new
    version, "removed" from the repository); it unloads once `in_flight` is 0.
    """

    def __init__(self, entry: Entry, runtime: ServedModel, config: ServerConfig,
                 metrics: Metrics) -> None:
        limit = runtime.max_target_positions - 1
        # an encoder-only model generates nothing: the server's decoding default is not its
        if config.default_max_new_tokens > limit and not runtime.config.encoder_only:
            raise ValueError(f"--default-max-new-tokens {config.default_max_new_tokens} is "
                             f"over the model's limit of {limit} new tokens")
        self.entry = entry
        self.name = entry.name
        self.version = entry.version
        self.memory_bytes = entry.memory_bytes
        self.runtime = runtime
        self.scheduler = Scheduler(runtime, config.scheduler_config(),
                                   metrics.for_model(entry.name))
        self.submitter = Submitter(runtime, config, self.scheduler)
        self.decode = runtime.tokenizer.decode
        self.in_flight = 0
        self.last_used = 0.0
        self.retired = ""

    def close(self) -> None:
        """Stop the scheduler's worker (requests still queued fail Unavailable); the runtime
        goes with the last reference to it."""
        self.scheduler.stop()

    def __repr__(self) -> str:
        return f"LoadedModel({self.name!r}, version={self.version!r})"


def runtime_entry(runtime: ServedModel, path: Path | None) -> Entry:
    """The entry of a runtime built by the caller: named after `path` (--model) or the
    runtime's directory, versioned from its files when they can be read."""
    where = path if path is not None else getattr(runtime, "directory", None)
    config = runtime.config
    if where is not None:
        try:
            entry = single_entry(Path(where))
            return replace(entry, model_name=config.name,
                           source_language=config.source_language,
                           target_language=config.target_language, manifest_error="")
        except OSError:
            pass
    name = Path(where).resolve().name if where is not None else "model"
    return Entry(name, Path(where or "."), "", 0, config.name, config.source_language,
                 config.target_language)


def release_freed_memory() -> None:
    """Free an unloaded model's memory and hand it back to the kernel. The model's objects
    hold reference cycles (the scheduler and its parts), so they go with a collection, not
    with their last reference; then glibc's malloc_trim, as the server otherwise keeps freed
    memory for reuse (tfserve.serving.process_tuning.keep_freed_memory) and in the heap of the
    thread that
    loaded the model, where another model's load would not find it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
