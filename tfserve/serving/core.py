"""The part of a server that does not depend on its transport: the models (a
tfserve.serving.repository.ModelRepository, each loaded model with its own scheduler), the
metrics, the calls in flight, and the steps of starting and draining.

A front end (tfserve.serving.grpc_server) owns one `ServingCore` and wraps its own listener
around these steps:

    start:  serve_metrics() -> bind the transport -> start() -> accept calls
    drain:  begin_drain() -> refuse new calls -> await wait_idle(grace) -> stop the
            transport -> await stop()

A call names its model: `await core.model(name, call)` loads it when needed and counts the
call in the model's requests in flight until the call ends (so that the model is not
unloaded under it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tfserve.scheduler import Scheduler
from tfserve.serving.calls import Call, Calls
from tfserve.serving.loaded import LoadedModel
from tfserve.serving.model_info import ModelInfo, model_info, unloaded_model_info
from tfserve.serving.model_scan import Entry
from tfserve.serving.repository import ModelRepository, ModelStatus
from tfserve.serving.requests import Submitter
from tfserve.serving.settings import ServerConfig
from tfserve.serving.status import ModelLoadFailed
from tfserve.serving.tracing import start_tracing
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.server")


def load_runtime(config: ServerConfig) -> Any:
    """The Runtime for --model (the bundled demo when none is given), --device, --threads."""
    from tfserve.runtime import Runtime

    model = config.model
    if model is None:
        from tfserve.demo import default_artifacts

        model = default_artifacts()
    return Runtime(model, device=config.device, intra_op_threads=config.threads,
                   pack_weights=config.pack_weights)


class ServingCore:
    """Models + metrics + calls, for any front end.

    `runtime` is any object with Runtime's interface (Backend + .tokenizer, .config,
    .manifest), served as the one model; None loads what `config` names (--model, the bundled
    demo, or --model-repository). Tracing is set up first, before any model loads, so that a
    missing OpenTelemetry fails the start at once.
    """

    def __init__(self, config: ServerConfig, runtime: Any | None = None,
                 metrics: Metrics | None = None) -> None:
        self.config = config.validate()
        tracing = start_tracing(config.otel_endpoint)
        self.metrics = metrics or Metrics(by_model=config.model_repository is not None)
        self.repository = ModelRepository.from_config(self.config, self.metrics, runtime)
        self.repository.load_initial()
        self.calls = Calls(self.metrics, config.max_message_bytes, tracing,
                           self.repository.release)
        self.metrics_port = 0
        # ModelInfo of models not loaded, by (name, version): read once from their files
        self._described: dict[tuple[str, str], ModelInfo] = {}

    # the default model's parts, while it is loaded (a one-model server's, for tests and
    # tools); None otherwise
    @property
    def default_model(self) -> LoadedModel | None:
        return self.repository.loaded()

    @property
    def runtime(self) -> Any:
        model = self.default_model
        return model.runtime if model is not None else None

    @property
    def scheduler(self) -> Scheduler | None:
        model = self.default_model
        return model.scheduler if model is not None else None

    @property
    def submitter(self) -> Submitter | None:
        model = self.default_model
        return model.submitter if model is not None else None

    async def model(self, name: str, call: Call) -> LoadedModel:
        """The model `name` names (empty: the default), loaded, counted in flight with the
        call until it ends (Call.finish releases it). ModelNotFound, InvalidArgument (empty
        and no default), ModelCapacity or ModelLoadFailed otherwise."""
        model = await self.repository.acquire(name)
        call.use(model)
        return model

    def model_info(self, model: LoadedModel | None = None) -> ModelInfo:
        """The ModelInfo of `model` (default: the default model, which must be loaded)."""
        model = model or self.default_model
        if model is None:
            raise LookupError("the default model is not loaded")
        return model_info(model.runtime, self.config, model.scheduler.max_new_tokens_limit,
                          model.name, model.version)

    async def describe(self, name: str, call: Call) -> ModelInfo:
        """The ModelInfo of the model `name` names (empty: the default). A model that is not
        loaded is described from its files without loading it (no sessions, so nothing
        else is unloaded under --max-loaded-models; a model whose last load failed too: the
        next request tries the load again); one whose files cannot be read answers
        ModelLoadFailed with the reason, loading nothing."""
        slot = self.repository.slot(name)
        call.concerns(slot.name)
        if slot.model is not None:
            return self.model_info(await self.model(name, call))
        entry = slot.entry
        if entry.manifest_error:
            raise self._unreadable(entry, entry.manifest_error)
        key = (entry.name, entry.version)
        described = self._described.get(key)
        if described is None:
            try:
                described = await asyncio.to_thread(
                    unloaded_model_info, entry.path, self.config, entry.name, entry.version)
            except (OSError, ValueError) as exc:  # ManifestError, TokenizerError
                raise self._unreadable(entry, str(exc)) from exc
            # one version per model: a replaced version's description goes
            self._described = {k: v for k, v in self._described.items() if k[0] != entry.name}
            self._described[key] = described
        return described

    def _unreadable(self, entry: Entry, reason: str) -> ModelLoadFailed:
        """A model described from its files that cannot be read: the log gets the full
        reason, the client the repository's (paths relative to the repository)."""
        log.warning("model %s: version %s cannot be described: %s", entry.name,
                    entry.version, reason)
        return self.repository.failure(entry, reason)

    def list_models(self) -> tuple[list[ModelStatus], str]:
        """Every model's status, and the default model's name ("" when there is none)."""
        return self.repository.statuses(), self.repository.default_name

    def serve_metrics(self) -> None:
        """Open the metrics port (when there is one). First thing at start: a busy port then
        fails before anything runs that would need stopping (a started gRPC server
        outliving its event loop)."""
        config = self.config
        if config.metrics_port:
            self.metrics_port = self.metrics.serve_http(config.metrics_port,
                                                        config.metrics_bind_host())

    def start(self) -> None:
        """Start the models' workers and the repository's poller (on the event loop); once
        the transport is bound, so that nothing needs stopping when it cannot bind."""
        self.repository.start()

    def begin_drain(self) -> None:
        """Refuse new calls (Draining) and new scheduler work from now on."""
        self.calls.draining = True
        self.repository.close_intake()

    async def wait_idle(self, grace: float) -> None:
        """Wait, for at most `grace` seconds, until no call is in flight."""
        try:
            await asyncio.wait_for(self.calls.idle.wait(), timeout=grace)
        except asyncio.TimeoutError:
            log.warning("grace period over with %d request(s) in flight",
                        self.calls.in_flight)

    async def stop(self) -> None:
        """Stop the models' workers (joined off the loop) and the metrics port."""
        await self.repository.stop()
        self.metrics.close()
        log.info("stopped", extra={"fields": {"event": "stopped"}})

    def stop_now(self) -> None:
        """Stop the models' workers at once (a second signal during the drain)."""
        self.repository.stop_now()
