"""The part of a server that does not depend on its transport: the model, the scheduler, the
metrics, the calls in flight, and the steps of starting and draining.

A front end (tfserve.serving.grpc_server) owns one `ServingCore` and wraps its own listener
around these steps:

    start:  serve_metrics() -> bind the transport -> start() -> accept calls
    drain:  begin_drain() -> refuse new calls -> await wait_idle(grace) -> stop the
            transport -> await stop()
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tfserve.metrics import Metrics
from tfserve.scheduler import Scheduler
from tfserve.serving.calls import Calls
from tfserve.serving.model_info import ModelInfo, model_info
from tfserve.serving.requests import Submitter
from tfserve.serving.tracing import start_tracing
from tfserve.settings import ServerConfig

log = logging.getLogger("tfserve.server")


def load_runtime(config: ServerConfig) -> Any:
    """The Runtime for --model (the bundled demo when none is given), --device, --threads."""
    from tfserve.runtime import Runtime

    model = config.model
    if model is None:
        from tfserve.demo import default_artifacts

        model = default_artifacts()
    return Runtime(model, device=config.device, intra_op_threads=config.threads)


class ServingCore:
    """Model + scheduler + metrics + calls, for any front end.

    `runtime` is any object with Runtime's interface (Backend + .tokenizer, .config,
    .manifest); None loads the one `config` names.
    """

    def __init__(self, config: ServerConfig, runtime: Any | None = None,
                 metrics: Metrics | None = None) -> None:
        self.config = config.validate()
        if runtime is None:
            runtime = load_runtime(config)
        self.runtime = runtime
        limit = runtime.max_target_positions - 1
        if config.default_max_new_tokens > limit:
            raise ValueError(f"--default-max-new-tokens {config.default_max_new_tokens} is over "
                             f"the model's limit of {limit} new tokens")
        self.metrics = metrics or Metrics()
        self.scheduler = Scheduler(runtime, config.scheduler_config(), self.metrics)
        self.calls = Calls(self.metrics, config.max_message_bytes,
                           start_tracing(config.otel_endpoint))
        self.submitter = Submitter(runtime, self.config, self.scheduler)
        self.metrics_port = 0

    def serve_metrics(self) -> None:
        """Open the metrics port (when there is one). First thing at start: a busy port then
        fails before anything runs that would need stopping (a started gRPC server
        outliving its event loop)."""
        config = self.config
        if config.metrics_port:
            self.metrics_port = self.metrics.serve_http(config.metrics_port,
                                                        config.metrics_bind_host())

    def start(self) -> None:
        """Start the scheduler's worker; once the transport is bound, so that nothing needs
        stopping when it cannot bind."""
        self.scheduler.start()

    def begin_drain(self) -> None:
        """Refuse new calls (Draining) and new scheduler work from now on."""
        self.calls.draining = True
        self.scheduler.close()

    async def wait_idle(self, grace: float) -> None:
        """Wait, for at most `grace` seconds, until no call is in flight."""
        try:
            await asyncio.wait_for(self.calls.idle.wait(), timeout=grace)
        except asyncio.TimeoutError:
            log.warning("grace period over with %d request(s) in flight",
                        self.calls.in_flight)

    async def stop(self) -> None:
        """Stop the scheduler's worker (joined off the loop) and the metrics port."""
        await asyncio.to_thread(self.scheduler.stop)
        self.metrics.close()
        log.info("stopped", extra={"fields": {"event": "stopped"}})

    def model_info(self) -> ModelInfo:
        return model_info(self.runtime, self.config, self.scheduler.max_new_tokens_limit)
