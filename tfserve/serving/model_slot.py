"""A model's place in the repository (`ModelSlot`: the entry on disk, the version loaded, the
load in progress, why the last load failed), its state and health, and how ListModels shows it
(`ModelStatus`). tfserve.serving.repository changes the slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from tfserve.serving.loaded import LoadedModel
from tfserve.serving.model_scan import Entry

HealthListener = Callable[[str, str], None]  # (model, SERVING | NOT_SERVING | SERVICE_UNKNOWN)


class ModelSlot:
    """A model's place in the repository: the entry last seen on disk, the version serving,
    the load in progress, and why the last load failed."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.model: LoadedModel | None = None
        self.loading: asyncio.Task[LoadedModel] | None = None
        self.loading_entry: Entry | None = None  # what `loading` loads (counted in the limits)
        self.waiting = 0  # requests waiting for `loading`: the slot must not be unloaded
        self.error = ""  # why the last load failed ("" after a load that succeeded)
        self.failed_version = ""  # the version that failed: not retried until it changes
        self.removed = False

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def state(self) -> str:
        """unloaded, loading, loaded or failed (a load in progress of a new version beside
        a loaded one shows as loaded)."""
        if self.model is not None:
            return "loaded"
        if self.loading is not None:
            return "loading"
        return "failed" if self.error else "unloaded"

    @property
    def health(self) -> str:
        """SERVING while the model answers or can be loaded, NOT_SERVING when its last load
        failed, SERVICE_UNKNOWN once it is removed."""
        if self.removed:
            return "SERVICE_UNKNOWN"
        return "NOT_SERVING" if self.state == "failed" else "SERVING"

    def status(self, in_flight: int, is_default: bool) -> ModelStatus:
        """The slot as ListModels shows it: `in_flight`, the requests in flight on every
        version of it still loaded."""
        entry, model = self.entry, self.model
        return ModelStatus(
            name=self.name, state=self.state, version=entry.version,
            loaded_version=model.version if model is not None else "",
            model_name=entry.model_name, source_language=entry.source_language,
            target_language=entry.target_language, memory_bytes=entry.memory_bytes,
            in_flight=in_flight, last_error=self.error, is_default=is_default)


@dataclass(frozen=True)
class ModelStatus:
    """One model as ListModels shows it."""

    name: str
    state: str
    version: str
    loaded_version: str
    model_name: str
    source_language: str
    target_language: str
    memory_bytes: int
    in_flight: int
    last_error: str
    is_default: bool
