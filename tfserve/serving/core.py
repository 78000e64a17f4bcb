"""The part of a server that does not depend on its transport: the models (a
tfserve.serving.repository.ModelRepository, each loaded model with its own scheduler), the
metrics, the calls in flight, the steps of each RPC, and the steps of starting and draining.

Each RPC is one method, the same for every front end (tfserve.frontends): plain values in (a
`Call`, which carries the request id, the deadline, the peer and the trace context, and the
request as TranslateInput / EncodeInput or a model's name and version), plain results out.
Each begins its call (refused while draining, or with the error the call was refused for
before it began: Call.refuse), finds the model, submits, waits and returns; the front end
renders the result in its wire format and ends the call (`call.finish(Status.OK)` once its
answer is made, or `call.failed(exc)` for the status to answer):

    translate         TranslateInput -> each input's hypotheses, with their texts
    translate_documents  TranslateInput -> each input's TranslatedText (hypotheses, a
                      document's segments, the language detected)
    translate_stream  TranslateInput -> stream Chunks (text deltas, then each input's last)
    detect            DetectInput -> each text's language (LanguageGuess)
    encode            EncodeInput -> each input's Encoded (embedding, hidden states)
    model_info        model name, version -> ModelInfo (loaded or described from its files)
    list_models       -> every model's ModelStatus and the default model's name

The server process (tfserve.server.translator_server) wraps its front ends' listeners around
the core's own lifecycle:

    start:  serve_metrics() -> bind the front ends -> start() -> they serve
    drain:  begin_drain() -> refuse new calls -> await wait_idle(grace) -> stop the front
            ends -> await stop()

A call that runs on a model counts in the model's requests in flight until the call ends (so
that the model is not unloaded under it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from tfserve.scheduler import Encoded
from tfserve.serving.calls import Call, Calls
from tfserve.serving.detection import LanguageGuess, detect_texts
from tfserve.serving.documents import TranslatedText
from tfserve.serving.loaded import LoadedModel
from tfserve.serving.model_info import ModelInfo, model_info, unloaded_model_info
from tfserve.serving.model_scan import Entry
from tfserve.serving.model_slot import ModelStatus
from tfserve.serving.repository import ModelRepository
from tfserve.serving.requests import DetectInput, EncodeInput, TranslateInput
from tfserve.serving.results import TextHypothesis, with_texts
from tfserve.serving.served_model import ServedModel
from tfserve.serving.settings import ServerConfig
from tfserve.serving.status import ModelLoadFailed
from tfserve.serving.stream import Chunk, TokenStream
from tfserve.serving.tracing import start_tracing
from tfserve.telemetry.metrics import Metrics

log = logging.getLogger("tfserve.server")


class ServingCore:
    """Models + metrics + calls, for any front end.

    `runtime` is a model built by the caller (a ServedModel, as tfserve.runtime.Runtime),
    served as the one model; None loads what `config` names (--model, the bundled demo, or
    --model-repository). Tracing is set up first, before any model loads, so that a
    missing OpenTelemetry fails the start at once.
    """

    def __init__(self, config: ServerConfig, runtime: ServedModel | None = None,
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

    # -- the RPCs ---------------------------------------------------------------------------

    async def translate(self, call: Call, request: TranslateInput
                        ) -> list[list[TextHypothesis]]:
        """Translate: the hypotheses of each input, in order, with their texts (a
        document's: the documents of its n-best list, tfserve.serving.documents)."""
        return [[TextHypothesis(found.text, found.token_ids, found.score)
                 for found in translated.hypotheses]
                for translated in await self.translate_documents(call, request)]

    async def translate_documents(self, call: Call, request: TranslateInput
                                  ) -> list[TranslatedText]:
        """Translate: each input's answer, in order: its hypotheses and, for a text split
        into sentences, its segments and the language detected (source_language "auto").
        A document's sentences are rows of the one job, joined back once it has ended."""
        call.begin()
        model = await self._acquire(call, request.model, request.version)
        job, documents = await model.submitter.submit_documents(request, call)
        return documents.results(with_texts(await call.wait(job), model.decode))

    async def detect(self, call: Call, request: DetectInput) -> list[LanguageGuess]:
        """Detect: each text's language, with the model's code for it where the model has
        language codes."""
        call.begin()
        model = await self._acquire(call, request.model, request.version)
        return await detect_texts(request.texts, model.runtime.tokenizer, self.config)

    async def translate_stream(self, call: Call, request: TranslateInput
                               ) -> AsyncIterator[Chunk]:
        """TranslateStream: a chunk whenever an input's text grows, and one last chunk per
        input; the job's error, if it failed, once its chunks are out."""
        call.begin()
        model = await self._acquire(call, request.model, request.version)
        stream = TokenStream(asyncio.get_running_loop())
        job, documents = await model.submitter.submit_documents(request, call, stream.on_event)
        call.job = job
        await call.accepted()
        stream.end_with(job)
        async for chunk in stream.chunks(model.decode, documents):
            yield chunk
        await call.wait(job)  # raises the job's error, if it failed

    async def encode(self, call: Call, request: EncodeInput) -> list[Encoded]:
        """Encode: each input's embedding (and hidden states, when asked for), in order."""
        call.begin()
        model = await self._acquire(call, request.model, request.version)
        return await call.wait(await model.submitter.submit_encode(request, call))

    async def model_info(self, call: Call, name: str, version: str = "") -> ModelInfo:
        """GetModelInfo of the model `name` names (empty: the default), at `version` ("":
        whichever serves). A model that is not loaded is described from its files without
        loading it (no sessions, so nothing else is unloaded under --max-loaded-models; a
        model whose last load failed too: the next request tries the load again); one whose
        files cannot be read answers ModelLoadFailed with the reason, loading nothing."""
        call.begin()
        slot = self.repository.slot(name, version)
        call.concerns(slot.name)
        if slot.model is not None:
            return self._loaded_info(await self._acquire(call, name, version))
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

    async def list_models(self, call: Call) -> tuple[list[ModelStatus], str]:
        """ListModels: every model's status, and the default model's name ("" when there is
        none)."""
        call.begin()
        return self.repository.statuses(), self.repository.default_name

    async def _acquire(self, call: Call, name: str, version: str) -> LoadedModel:
        """The model `name` names (empty: the default), loaded, counted in flight with the
        call until it ends (Call.finish releases it). ModelNotFound, InvalidArgument (empty
        and no default), ModelCapacity or ModelLoadFailed otherwise."""
        model = await self.repository.acquire(name, version)
        call.use(model)
        return model

    def _loaded_info(self, model: LoadedModel) -> ModelInfo:
        """The ModelInfo of a loaded model."""
        return model_info(model.runtime, self.config, model.scheduler.max_new_tokens_limit,
                          model.name, model.version)

    def _unreadable(self, entry: Entry, reason: str) -> ModelLoadFailed:
        """A model described from its files that cannot be read: the log gets the full
        reason, the client the repository's (paths relative to the repository)."""
        log.warning("model %s: version %s cannot be described: %s", entry.name,
                    entry.version, reason)
        return self.repository.failure(entry, reason)

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
