"""The models one server serves, loaded and unloaded while it serves: `ModelRepository`.

A repository is `serve --model-repository DIR` (tfserve.serving.model_scan finds its models),
or `serve --model DIR` as a repository of one. Each model has a `ModelSlot`
(tfserve.serving.model_slot), and each loaded
version of a model is a `LoadedModel`: its runtime, its own scheduler (one worker thread, one
continuous batch) and the submitter that checks requests against it.

- **Choosing.** A request's `model` names a slot; empty means the only model, or
  --default-model. An unknown name is ModelNotFound (NOT_FOUND), naming the models served.
- **Loading.** --load eager loads every model at start, as far as the limits allow; --load
  lazy loads a model on its first request, which waits for it. However many requests wait,
  a model is loaded once: they await the same task. The load itself (ONNX Runtime sessions)
  runs on a thread, off the event loop.
- **Unloading.** Before a load, the least recently used models without requests in flight
  are unloaded until the new one fits under --max-loaded-models and --max-model-memory (a
  model counted for the size of its artifact files, model_scan.Entry). A model with
  requests in flight, or with requests waiting for its load, is never unloaded; when every
  loaded model is busy the load is refused (ModelCapacity: RESOURCE_EXHAUSTED, retry).
- **Polling.** `rescan()` (every --repository-poll-seconds, or called by a test) compares the
  directory with the slots: a new model becomes servable (and is loaded, with --load eager),
  a removed one is no longer routed to and unloads once its requests in flight have
  finished, and a new version of a loaded model is loaded beside the old one and swapped in
  once ready; requests in flight finish on the version they started on, which unloads after
  them. A new version that fails to load is refused (logged, counted as a failed load, shown
  by ListModels) and the old one keeps serving.

Everything that changes a slot runs on the event loop's thread, so a decision and the change
it leads to (a swap, choosing a model to unload, counting a request in) happen with no other
request in between. Each model's scheduler has a thread of its own: the operating system
shares the cores among the models that are busy, so a lone request to an idle model is
decoded beside a saturated one rather than behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tfserve.serving.loaded import (
    LoadedModel,
    Loader,
    release_freed_memory,
    runtime_entry,
    runtime_loader,
)
from tfserve.serving.model_scan import Entry, relative_paths, scan, single_entry
from tfserve.serving.model_slot import HealthListener, ModelSlot, ModelStatus
from tfserve.serving.requests import InvalidArgument, shown
from tfserve.serving.served_model import ServedModel
from tfserve.serving.settings import ServerConfig
from tfserve.serving.status import ModelCapacity, ModelLoadFailed, ModelNotFound
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.server")

MAX_NAMES_SHOWN = 20  # models named in a NOT_FOUND message


class ModelRepository:
    """The slots by name, and the loads, unloads and rescans that change them.

    `directory` is --model-repository (None for a repository of one, `entries` then holding
    it); `loader` turns an entry into a runtime (runtime_loader: ONNX Runtime); `preloaded`
    maps a name to a runtime built by the caller (a test's shared runtime). `strict`: a model
    that fails to load at start fails the start (`--model DIR`), instead of being marked
    failed while the others serve.
    """

    def __init__(self, config: ServerConfig, metrics: Metrics, entries: dict[str, Entry],
                 loader: Loader, directory: Path | None = None,
                 preloaded: dict[str, ServedModel] | None = None, strict: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.metrics = metrics
        self.directory = directory
        self.loader = loader
        self.preloaded = dict(preloaded or {})
        self.strict = strict
        self.clock = clock
        self.slots: dict[str, ModelSlot] = {name: ModelSlot(entry)
                                            for name, entry in sorted(entries.items())}
        self.resident: set[LoadedModel] = set()  # loaded versions not closed yet
        self._closing: dict[LoadedModel, asyncio.Task[None]] = {}
        self._listeners: list[HealthListener] = []
        self._warned: set[str] = set()
        self._started = False
        self._stopped = False
        self._poller: asyncio.Task[None] | None = None
        if config.default_model and config.default_model not in self.slots:
            where = (f"--model-repository {directory}" if directory is not None
                     else "the model served")
            raise ValueError(f"--default-model {config.default_model!r} is not a model of "
                             f"{where}; {self._names_text()}")

    @classmethod
    def from_config(cls, config: ServerConfig, metrics: Metrics,
                    runtime: ServedModel | None = None) -> ModelRepository:
        """--model-repository, --model, or the bundled demo; `runtime`: the one model, built
        by the caller (then --model only names it)."""
        loader = runtime_loader(config)
        if config.model_repository is not None:
            directory = Path(config.model_repository)
            if not directory.is_dir():
                raise ValueError(f"--model-repository {directory}: not a directory")
            warned: set[str] = set()
            found = scan(directory, warned)
            repository = cls(config, metrics, found.entries, loader, directory)
            repository._warned = warned
            return repository
        if runtime is not None:
            entry = runtime_entry(runtime, config.model)
            return cls(config, metrics, {entry.name: entry}, loader,
                       preloaded={entry.name: runtime}, strict=True)
        path = config.model
        name = ""
        if path is None:
            from tfserve.demo import default_artifacts

            path, name = default_artifacts(), "demo"
        try:
            entry = single_entry(Path(path), name)
        except OSError as exc:
            raise ValueError(f"--model {path}: cannot read it ({exc.strerror or exc})") from None
        return cls(config, metrics, {entry.name: entry}, loader, strict=True)

    # -- names ------------------------------------------------------------------------------

    @property
    def default_name(self) -> str:
        """What an empty `model` means: --default-model, else the only model ("" when there
        are several)."""
        if self.config.default_model:
            return self.config.default_model
        return next(iter(self.slots)) if len(self.slots) == 1 else ""

    def _names_text(self) -> str:
        names = list(self.slots)
        if not names:
            # clients never see the server's paths: the directory is in the server's log
            return ("the model repository (--model-repository) holds no model now (a "
                    "subdirectory with a model.json)")
        shown_names = ", ".join(names[:MAX_NAMES_SHOWN])
        more = f" and {len(names) - MAX_NAMES_SHOWN} more" if len(names) > MAX_NAMES_SHOWN else ""
        return f"the models are: {shown_names}{more} (ListModels, GET /v1/models)"

    def slot(self, name: str, version: str = "") -> ModelSlot:
        """The slot a request's `model` names; ModelNotFound naming the models served, or
        InvalidArgument when `model` is empty and there is no default. A `version` ("":
        any) must be the one serving (ModelNotFound naming it otherwise)."""
        found = self._named_slot(name)
        if version:
            self._check_version(found, version)
        return found

    def _named_slot(self, name: str) -> ModelSlot:
        if not self.slots:
            raise ModelNotFound(f"no model is served: {self._names_text()}")
        if not name:
            name = self.default_name
            if not name:
                raise InvalidArgument(f"model is empty and this server serves {len(self.slots)} "
                                      f"models with no --default-model: name one; "
                                      f"{self._names_text()}")
            found = self.slots.get(name)
            if found is None:
                raise ModelNotFound(f"model is empty and the default model {name!r} is not in "
                                    f"the repository now; {self._names_text()}")
            return found
        found = self.slots.get(name)
        if found is None:
            raise ModelNotFound(f"model {shown(name)} is not served here; {self._names_text()}")
        return found

    @staticmethod
    def _check_version(slot: ModelSlot, version: str) -> None:
        """ModelNotFound unless `version` is the slot's version serving (the loaded one, or
        the one on disk while none is loaded)."""
        serving = slot.model.version if slot.model is not None else slot.entry.version
        if version != serving:
            raise ModelNotFound(f"model {shown(slot.name)} has no version {shown(version)}: "
                                f"its version is {serving!r}")

    def loaded(self, name: str = "") -> LoadedModel | None:
        """The version of `name` (empty: the default model) answering now, None when it is not
        loaded (or there is no such model)."""
        slot = self.slots.get(name or self.default_name)
        return slot.model if slot is not None else None

    # -- requests ---------------------------------------------------------------------------

    async def acquire(self, name: str, version: str = "") -> LoadedModel:
        """The model a request names, loaded (waiting for its load), with the request counted
        in its in-flight requests until `release`; at `version`, when one is given."""
        slot = self.slot(name, version)
        while True:
            model = slot.model
            if model is not None:  # no await from here to the count: no unload in between
                if version:
                    self._check_version(slot, version)  # a version swapped in meanwhile
                model.in_flight += 1
                model.last_used = self.clock()
                self.metrics.model_in_flight.labels(model.name).inc()
                return model
            if slot.removed:
                raise ModelNotFound(f"model {shown(slot.name)} was removed from the "
                                    f"repository; {self._names_text()}")
            slot.waiting += 1
            try:
                await self._load(slot)
            finally:
                slot.waiting -= 1

    def release(self, model: LoadedModel) -> None:
        """A request counted by `acquire` has ended; a retired version with none left
        unloads."""
        model.in_flight -= 1
        model.last_used = self.clock()
        self.metrics.model_in_flight.labels(model.name).dec()
        if model.retired and model.in_flight == 0:
            self._close_later(model, model.retired)

    # -- loading ----------------------------------------------------------------------------

    def load_initial(self) -> None:
        """--load eager, at start (before the event loop serves): load every model, in name
        order, as far as the limits allow (no unloading at start); the others stay unloaded
        until a request comes. A failure fails the start when `strict`, else marks the model
        failed."""
        if not self.slots:
            log.warning("model repository %s holds no model (a subdirectory with a "
                        "model.json): every request is NOT_FOUND until one is added",
                        self.directory)
        lazy = self.config.load == "lazy"
        for slot in self.slots.values():
            preloaded = slot.name in self.preloaded
            if lazy and not preloaded:
                continue
            if not preloaded and self._over_limits(extra=slot.entry):
                log.info("model %s not loaded at start: %s; it loads on its first request",
                         slot.name, self._over_limits(extra=slot.entry))
                continue
            started = time.perf_counter()
            try:
                model = self._build(slot.entry)
            except Exception as exc:
                if self.strict:
                    raise
                self._load_failed(slot, slot.entry, exc)
                continue
            self._install(slot, model, time.perf_counter() - started)

    def _build(self, entry: Entry) -> LoadedModel:
        """The entry loaded (runtime, scheduler not started); on a thread, or at start."""
        runtime = self.preloaded.get(entry.name)
        if runtime is None:
            runtime = self.loader(entry)
        return LoadedModel(entry, runtime, self.config, self.metrics)

    async def _load(self, slot: ModelSlot) -> None:
        """Load the slot's entry, or wait for the load in progress: one load however many
        requests wait. Raises what the load raised."""
        if slot.loading is None:
            self._start_load(slot, slot.entry)
        assert slot.loading is not None
        # shielded: a waiting request that is cancelled does not cancel the others' load
        await asyncio.shield(slot.loading)

    def _start_load(self, slot: ModelSlot, entry: Entry) -> asyncio.Task[LoadedModel]:
        slot.loading_entry = entry  # counted in the limits from now on
        task = asyncio.get_running_loop().create_task(self._load_version(slot, entry))
        # a load whose waiters all left still has its outcome read (no "never retrieved")
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        slot.loading = task
        self._notify(slot)
        return task

    async def _load_version(self, slot: ModelSlot, entry: Entry) -> LoadedModel:
        """Make room, load `entry` off the loop, install it in the slot (swapping out the
        version it replaces)."""
        try:
            # a load known to fail (RuntimeLoader.refusal) fails before anything else is
            # unloaded to make room for it
            refusal = getattr(self.loader, "refusal", None)
            reason = refusal(entry) if refusal is not None else ""
            if reason:
                raise self._load_failed(slot, entry, ValueError(reason))
            await self._make_room(slot, entry)
            started = time.perf_counter()
            try:
                model = await asyncio.to_thread(self._build, entry)
            except Exception as exc:
                raise self._load_failed(slot, entry, exc) from exc
        finally:
            slot.loading = slot.loading_entry = None
            self._notify(slot)  # failed, or unloaded (refused for capacity), or loaded below
        if self._stopped or slot.removed:
            await asyncio.to_thread(model.close)
            self._notify(slot)
            raise ModelNotFound(f"model {shown(slot.name)} was removed while it loaded; "
                                f"{self._names_text()}")
        self._install(slot, model, time.perf_counter() - started)
        return model

    def _install(self, slot: ModelSlot, model: LoadedModel, seconds: float) -> None:
        """Make `model` the slot's serving version (the old one, if any, retires: it unloads
        once its requests in flight have finished)."""
        old = slot.model
        slot.model = model
        slot.error = slot.failed_version = ""
        model.last_used = self.clock()
        self.resident.add(model)
        if self._started:
            model.scheduler.start()
        name = model.name
        self.metrics.model_loads.labels(name, "ok").inc()
        self.metrics.model_load_seconds.labels(name).observe(seconds)
        self.metrics.model_loaded.labels(name).set(1)
        self._count_memory(name)
        log.info("model loaded", extra={"fields": {
            "event": "model_loaded", "model": name, "version": model.version,
            "replaces": old.version if old is not None else "",
            "memory_bytes": model.memory_bytes, "load_seconds": round(seconds, 3)}})
        if old is not None:
            self._retire(old, "replaced")
        self._notify(slot)

    def _load_failed(self, slot: ModelSlot, entry: Entry, exc: BaseException) -> ModelLoadFailed:
        """Record a failed load (logged with the full paths, counted, shown by ListModels);
        the error requests waiting for it get."""
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
        slot.error = self.shown_reason(entry, reason)
        slot.failed_version = entry.version
        self.metrics.model_loads.labels(entry.name, "failed").inc()
        serving = slot.model.version if slot.model is not None else ""
        log.error("model %s: version %s cannot be loaded: %s%s", entry.name, entry.version,
                  reason, f"; version {serving} keeps serving" if serving else "")
        if not slot.loading:  # at start: no load task whose end notifies
            self._notify(slot)
        return self.failure(entry, reason)

    def shown_reason(self, entry: Entry, reason: str) -> str:
        """Why `entry` cannot load, as clients are told: the server's paths in `reason` made
        relative to the repository (`demo/encoder.onnx`, model_scan.relative_paths). Every
        reason a loader or a model's files give goes through here on its way to an answer;
        the server's log keeps it whole."""
        return relative_paths(reason, entry, self.directory)

    def failure(self, entry: Entry, reason: str) -> ModelLoadFailed:
        """The error a request to `entry` gets when its files cannot be loaded or read."""
        return ModelLoadFailed(f"model {entry.name!r} cannot be loaded: "
                               f"{self.shown_reason(entry, reason)}")

    # -- limits and unloading ---------------------------------------------------------------

    def _over_limits(self, extra: Entry | None = None) -> str:
        """Which limit the loaded and loading models (and `extra`) exceed, "" when none."""
        config = self.config
        count = sum(1 for slot in self.slots.values()
                    if slot.model is not None or slot.loading_entry is not None)
        memory = sum(model.memory_bytes for model in self.resident) + sum(
            slot.loading_entry.memory_bytes for slot in self.slots.values()
            if slot.loading_entry is not None)
        if extra is not None:
            count, memory = count + 1, memory + extra.memory_bytes
        if config.max_loaded_models and count > config.max_loaded_models:
            return f"--max-loaded-models {config.max_loaded_models} is reached"
        if config.max_model_memory and memory > config.max_model_memory:
            return (f"the models would take {memory} bytes, over --max-model-memory "
                    f"{config.max_model_memory}")
        return ""

    async def _make_room(self, slot: ModelSlot, entry: Entry) -> None:
        """Unload least recently used idle models until the loads in progress fit (the slot's
        own `loading_entry` included); ModelCapacity when they cannot."""
        limit = self.config.max_model_memory
        if limit and entry.memory_bytes > limit:
            raise _refused(entry, ModelCapacity(
                f"model {entry.name!r} is counted for {entry.memory_bytes} bytes (the size of "
                f"its files), over --max-model-memory {limit}"))
        while True:
            over = self._over_limits()
            if not over:
                return
            victim = self._least_recently_used(exclude=slot)
            if victim is not None:
                await self._unload(victim, "lru")
            elif self._closing:  # versions being unloaded: their memory is freed soon
                await asyncio.wait(set(self._closing.values()))
            else:
                raise _refused(entry, ModelCapacity(
                    f"model {entry.name!r} cannot be loaded now: {over} and every loaded model "
                    "has requests in flight; retry later"))

    def _least_recently_used(self, exclude: ModelSlot) -> ModelSlot | None:
        """The loaded slot used longest ago with nothing in flight, nothing waiting and
        nothing loading: what may be unloaded now."""
        idle = [slot for slot in self.slots.values()
                if slot is not exclude and slot.model is not None and slot.model.in_flight == 0
                and slot.waiting == 0 and slot.loading is None and slot.model.scheduler.idle]
        return min(idle, key=lambda slot: slot.model.last_used if slot.model else 0.0,
                   default=None)

    async def _unload(self, slot: ModelSlot, reason: str) -> None:
        """Take the slot's (idle) model out of service and unload it."""
        model = slot.model
        assert model is not None and model.in_flight == 0
        slot.model = None
        self._notify(slot)
        closing = self._close(model, reason)
        del model  # _close holds the last reference, and frees the model's memory
        await closing

    def _retire(self, model: LoadedModel, reason: str) -> None:
        """No new requests for `model` (the slot no longer points to it); it unloads when its
        requests in flight end. Its scheduler still takes theirs: one may be tokenizing, and
        submits after the swap."""
        model.retired = reason
        if model.in_flight == 0:
            self._close_later(model, reason)

    def _close_later(self, model: LoadedModel, reason: str) -> None:
        if model not in self._closing and model in self.resident:
            self._closing[model] = asyncio.get_running_loop().create_task(
                self._close(model, reason))

    async def _close(self, model: LoadedModel, reason: str) -> None:
        """Stop the model's worker (off the loop) and forget the model."""
        if model not in self._closing:  # registered at once: _make_room waits for it
            self._closing[model] = asyncio.current_task()  # type: ignore[assignment]
        try:
            await asyncio.to_thread(model.close)
        finally:
            self._closing.pop(model, None)
            self.resident.discard(model)
        name, version = model.name, model.version
        del model  # the last reference: the model goes with the collection below
        self.metrics.model_unloads.labels(name, reason).inc()
        slot = self.slots.get(name)
        if slot is None or slot.model is None:
            self.metrics.model_loaded.labels(name).set(0)
        self._count_memory(name)
        log.info("model unloaded", extra={"fields": {
            "event": "model_unloaded", "model": name, "version": version, "reason": reason}})
        # before a load that waits for this unload: the memory is back when it starts
        await asyncio.to_thread(release_freed_memory)

    def _count_memory(self, name: str) -> None:
        self.metrics.model_memory.labels(name).set(
            sum(model.memory_bytes for model in self.resident if model.name == name))

    # -- rescanning -------------------------------------------------------------------------

    async def rescan(self) -> None:
        """Bring the slots in line with the directory (see the module's docstring); returns
        once the loads it started have ended (each one loaded or refused)."""
        if self.directory is None or self._stopped:
            return
        found = await asyncio.to_thread(scan, self.directory, self._warned)
        loads: list[Awaitable[Any]] = []
        eager = self.config.load == "eager"
        for name, entry in found.entries.items():
            slot = self.slots.get(name)
            if slot is None:
                slot = self.slots[name] = ModelSlot(entry)
                self.slots = dict(sorted(self.slots.items()))
                log.info("model added", extra={"fields": {
                    "event": "model_added", "model": name, "version": entry.version}})
                self._notify(slot)
                if eager:
                    loads.append(self._start_load(slot, entry))
                continue
            changed = entry.version != slot.entry.version
            slot.entry = entry
            if slot.loading is not None:  # the next rescan loads the newest version
                continue
            if slot.model is None:
                if changed:
                    slot.error = slot.failed_version = ""  # the new version may load
                    self._notify(slot)
                    if eager:
                        loads.append(self._start_load(slot, entry))
            elif entry.version not in (slot.model.version, slot.failed_version):
                loads.append(self._start_load(slot, entry))  # beside the old; swapped in
        for name in list(self.slots):
            if name not in found.entries and name not in found.unreadable:
                self._remove(self.slots.pop(name))
        if loads:
            await asyncio.gather(*loads, return_exceptions=True)

    def _remove(self, slot: ModelSlot) -> None:
        """A model gone from the directory: no new requests; its version unloads once those
        in flight have finished."""
        slot.removed = True
        log.info("model removed", extra={"fields": {
            "event": "model_removed", "model": slot.name,
            "in_flight": slot.model.in_flight if slot.model else 0}})
        if slot.model is not None:
            model, slot.model = slot.model, None
            self._retire(model, "removed")
        self._notify(slot)

    async def _poll(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.rescan()
            except Exception:  # an unreadable directory: keep serving what is loaded
                log.exception("model repository: rescanning %s failed", self.directory)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """On the event loop, once the front ends are bound: start the loaded models'
        schedulers and the poller."""
        self._started = True
        for model in self.resident:
            model.scheduler.start()
        seconds = self.config.repository_poll_seconds
        if seconds and self.directory is not None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(seconds))

    def close_intake(self) -> None:
        """The drain: no rescans, and every scheduler refuses new work."""
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        for model in self.resident:
            model.scheduler.close()

    async def stop(self) -> None:
        """Stop every model's worker (joined off the loop)."""
        self.close_intake()
        self._stopped = True
        models = list(self.resident)
        self.resident.clear()
        await asyncio.gather(*(asyncio.to_thread(model.close) for model in models))

    def stop_now(self) -> None:
        """Stop every model's worker from this thread (a second signal during the drain)."""
        self._stopped = True
        for model in list(self.resident):
            model.scheduler.stop()

    # -- state ------------------------------------------------------------------------------

    def healths(self) -> list[tuple[str, str]]:
        """(model, health) for every model (ModelSlot.health)."""
        return [(slot.name, slot.health) for slot in self.slots.values()]

    def add_listener(self, listener: HealthListener) -> None:
        """Call `listener(model, health)` whenever a model's health may have changed (on the
        event loop)."""
        self._listeners.append(listener)

    def _notify(self, slot: ModelSlot) -> None:
        for listener in self._listeners:
            listener(slot.name, slot.health)

    def statuses(self) -> list[ModelStatus]:
        """Every model, by name, as ListModels shows it."""
        default = self.default_name
        return [slot.status(
            in_flight=sum(m.in_flight for m in self.resident if m.name == slot.name),
            is_default=slot.name == default) for slot in self.slots.values()]


def _refused(entry: Entry, exc: ModelCapacity) -> ModelCapacity:
    """A load refused for want of room: logged, and raised to the requests waiting for it."""
    log.warning("model %s: version %s not loaded: %s", entry.name, entry.version, exc)
    return exc
