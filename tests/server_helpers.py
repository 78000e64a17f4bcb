"""Helpers for the server tests: test models, a server on a background thread, a subprocess,
and gates that hold a server's decoder steps.

A real server listens on a loopback ephemeral port; the tests talk to it with real gRPC
clients (tfserve.client, or generic stubs for health and reflection).

Nothing here depends on how fast the machine is: a test that needs requests to be running at
some moment holds the model with a gate (`Gate` in process, `ProcessGate` for a subprocess)
rather than hoping that the work takes longer than the test's next move, and every wait is
for a state (an event, a log record, a queue length) with a generous timeout as a safety net.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tfserve.bench.common import proc_status_kib

ROOT = Path(__file__).resolve().parents[1]
DEMO_CHECKPOINT = ROOT / "tfserve" / "demo" / "checkpoint"


def export_random_model(out: Path, seed: int = 0, max_positions: int = 128) -> Path:
    """A small random RoPE model with the demo's tokenizer, exported to ONNX (needs torch).

    Random weights rarely emit eos, so outputs run to max_new_tokens: lengths are set by the
    request, which is what batching and cancellation tests want.
    """
    if (out / "model.json").is_file():
        return out
    import torch

    from export.cli import main as export_main
    from tfserve.artifacts.model_config import ModelConfig
    from tfserve.model import Seq2SeqTransformer, save_checkpoint

    checkpoint = out.parent / f"{out.name}-checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    for name in ("source.spm", "tokenizer.json"):
        shutil.copy(DEMO_CHECKPOINT / name, checkpoint / name)
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=111, d_model=32, num_heads=4, encoder_layers=2,
                         decoder_layers=2, ffn_dim=64, positions="rope", norm="pre",
                         max_source_positions=max_positions, max_target_positions=max_positions,
                         name="random-test-model")
    save_checkpoint(Seq2SeqTransformer(config).eval(), checkpoint)
    code = export_main(["--checkpoint", str(checkpoint), "--out", str(out), "--force", "--quiet",
                        "--parity-samples", "0"])
    if code != 0:
        raise RuntimeError(f"exporting the random test model failed (exit code {code})")
    return out


def demo_trained() -> bool:
    return (DEMO_CHECKPOINT / "model.safetensors").is_file()


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_args(model: Path, *extra: str) -> list[str]:
    """Flags for a test server: loopback, ephemeral port, no metrics or HTTP port, one ORT
    thread (a later --http-port wins)."""
    return ["--model", str(model), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--http-port", "0", "--threads", "1", "--log-level", "warning", *extra]


def repository_args(directory: Path, *extra: str) -> list[str]:
    """Flags for a test server of a repository: loopback, ephemeral ports, HTTP on."""
    return ["--model-repository", str(directory), "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0", "--http-port", str(free_port()), "--threads", "1",
            "--log-level", "warning", *extra]


def http_json(server: ServerThread, method: str, path: str, body: Any = None,
              timeout: float = 60.0) -> tuple[int, Any]:
    """An HTTP call to the server: its status and JSON answer."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(server.http_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def tfserve_records(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
                    level: int = logging.INFO, logger: str | None = "tfserve"
                    ) -> pytest.LogCaptureFixture:
    """pytest's caplog, with tfserve's records reaching it even after a test in this process
    ran tfserve.telemetry.logs.setup_logging (which stops them at the `tfserve` logger); capturing
    from `level` up on `logger` (None: the root logger)."""
    monkeypatch.setattr(logging.getLogger("tfserve"), "propagate", True)
    caplog.set_level(level, logger=logger)
    return caplog


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid` (VmRSS, Linux /proc)."""
    return proc_status_kib(pid, "VmRSS") * 1024


class ServerThread:
    """A TranslatorServer on its own event loop in a background thread.

        with ServerThread(server_args(model, "--max-batch-size", "8")) as server:
            Client(server.target) ...
            with Gate(server.scheduler) as gate: ...
    """

    def __init__(self, argv: Sequence[str], runtime: Any | None = None) -> None:
        from tfserve.server.translator_server import TranslatorServer
        from tfserve.serving.settings import parse_config

        self.config = parse_config(list(argv), environ={})
        self.server = TranslatorServer(self.config, runtime)
        self.core = self.server.core
        self.repository = self.core.repository
        self.metrics = self.core.metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    # the default model's parts while it is loaded (a one-model server's)
    @property
    def model(self) -> Any:
        model = self.repository.loaded()
        assert model is not None, "the default model is not loaded"
        return model

    @property
    def runtime(self) -> Any:
        return self.model.runtime

    @property
    def scheduler(self) -> Any:
        return self.model.scheduler

    @property
    def in_flight(self) -> int:
        """The calls in flight, of every front end."""
        return int(self.core.calls.in_flight)

    def front_end(self, kind: type) -> Any:
        """The server's front end of class `kind` (GrpcServer, HttpServer); None when off."""
        return next((front_end for front_end in self.server.front_ends
                     if isinstance(front_end, kind)), None)

    @property
    def port(self) -> int:
        """The gRPC port."""
        return int(self.server.ports()["port"])

    @property
    def http_port(self) -> int:
        """The HTTP port (0: HTTP is off)."""
        return int(self.server.ports().get("http_port", 0))

    @property
    def metrics_port(self) -> int:
        """The metrics port (0: none)."""
        return int(self.core.metrics_port)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP API's base URL (with --http-port)."""
        return f"http://127.0.0.1:{self.http_port}"

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await self.server.start()
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                raise
            self._ready.set()
            await self._stop.wait()
            await self.server.drain(grace=5.0)

        asyncio.run(main())

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("test server did not start within 60 s")
        if self._error is not None:
            raise RuntimeError(f"test server failed to start: {self._error}")
        return self

    def run_on_loop(self, coroutine_fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (e.g. server.drain) and wait for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine_fn(), self._loop).result(timeout)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
        """Wait for a state of the server (read on its event loop), checked after every turn of
        the loop: no fixed sleeps."""
        async def until() -> None:
            while not predicate():
                await asyncio.sleep(0)

        self.run_on_loop(until, timeout)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# a backend's model runs, by method, and the stage each one is: the encoder for translate
# requests, the encoder for Encode requests (a backend with `hidden_states`), a decoder step
MODEL_RUNS = {"encode": "encode", "hidden_states": "embed", "step": "step"}


def observed_run(run: Callable[..., Any], stage: str,
                 before: Callable[[str], None]) -> Callable[..., Any]:
    """`run` (a backend's model run) calling `before(stage)` first."""

    def observed(*args: Any, **kwargs: Any) -> Any:
        before(stage)
        return run(*args, **kwargs)

    return observed


class ObservedBackend:
    """A backend whose model runs (MODEL_RUNS) call `before(stage)` first, for a scheduler
    built over it: raising from `before` fails the run, blocking in it holds the model.
    Everything else is the backend's own."""

    def __init__(self, backend: Any, before: Callable[[str], None] | None = None) -> None:
        self.backend = backend
        self.before = before  # may be set late: read at each run

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.backend, name)
        if name not in MODEL_RUNS:
            return value
        return observed_run(value, MODEL_RUNS[name],
                            lambda stage: self.before(stage) if self.before else None)


class Gate:
    """Holds a running server's worker before each decoder step until the test lets it go, and
    records every model run: requests are provably still running while it holds. It wraps the
    model runs of the scheduler's backend (the loaded runtime) while it is open, as
    ObservedBackend does for a scheduler built over one.

        with Gate(server.scheduler) as gate:    # holds from here; opens on exit
            ... send requests ...
            gate.wait_held()                    # the worker waits before a step: its rows
            gate.step()                         # one step goes through, then it holds again
            gate.open()                         # every step goes through from now on

    `calls` lists (stage, rows decoding) for every model run ("encode", "embed", "step"), in
    order; `fail_next(stage)` makes the next run of that stage raise (a failed model run).
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.calls: list[tuple[str, int]] = []
        self._cond = threading.Condition()
        self._open = False
        self._allowed = 0  # steps that may go through while holding
        self._holding = False
        self._failures: list[str] = []

    def __enter__(self) -> Gate:
        backend = self.scheduler.backend
        for method, stage in MODEL_RUNS.items():
            run = getattr(backend, method, None)
            if run is not None:  # on the instance: what the scheduler's parts call
                setattr(backend, method, observed_run(run, stage, self._worker_run))
        return self

    def _worker_run(self, stage: str) -> None:
        """Before a run of the backend: gated when it is this scheduler's worker's (another
        server's, over the same runtime, goes through)."""
        if threading.current_thread() is self.scheduler._thread:
            self(stage)

    def __exit__(self, *exc: object) -> None:
        self.open()
        for method in MODEL_RUNS:
            self.scheduler.backend.__dict__.pop(method, None)

    def __call__(self, stage: str) -> None:  # the worker thread
        batch = self.scheduler._batch
        with self._cond:
            self.calls.append((stage, batch.rows - batch.retired_rows))
            if stage in self._failures:
                self._failures.remove(stage)
                raise RuntimeError(f"injected {stage} failure")
            if stage != "step":
                return
            while not self._open and not self._allowed:
                self._holding = True
                self._cond.notify_all()
                self._cond.wait()
            self._holding = False
            if not self._open:
                self._allowed -= 1

    def wait_held(self, timeout: float = 60.0) -> int:
        """Wait until the worker is held before a decoder step; the rows it would decode."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._holding, timeout):
                raise AssertionError("the worker did not reach a decoder step")
            return next(rows for stage, rows in reversed(self.calls) if stage == "step")

    def step(self, count: int = 1) -> None:
        with self._cond:
            self._allowed += count
            self._holding = False
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._holding = False
            self._cond.notify_all()

    def fail_next(self, stage: str) -> None:
        with self._cond:
            self._failures.append(stage)


def wait_queued(scheduler: Any, count: int, timeout: float = 60.0) -> None:
    """Wait until `count` inputs wait in the scheduler's queues, not taken by the worker yet
    (every submit notifies the scheduler's condition)."""
    policy = scheduler.policy

    def queued() -> int:
        return len(policy.translate_queue) + len(policy.encode_queue)

    with scheduler._cond:
        if not scheduler._cond.wait_for(lambda: queued() >= count, timeout):
            raise AssertionError(f"{queued()} inputs queued, not {count}")


# the sitecustomize module of a ProcessGate: Python imports it in every process it starts with
# the gate's directory on PYTHONPATH (the server, and each of its --workers)
_GATE_SITECUSTOMIZE = '''"""A test gate (tests/server_helpers.py, ProcessGate): while its socket
exists, each decoder step of a scheduler's worker thread in this process connects to it and
waits until the test lets go."""
import os
import socket
import threading


def _install(path):
    from tfserve.runtime import Runtime

    step = Runtime.step

    def gated_step(self, *args, **kwargs):
        # the schedulers' steps, not the warm-up step of a model's load
        if threading.current_thread().name == "tfserve-worker" and os.path.exists(path):
            with socket.socket(socket.AF_UNIX) as gate:
                try:
                    gate.connect(path)
                    gate.sendall(b"%d\\n" % os.getpid())
                    gate.recv(1)  # returns (or fails) when the test closes the gate
                except OSError:
                    pass  # the gate closed meanwhile
        return step(self, *args, **kwargs)

    Runtime.step = gated_step


if os.environ.get("TFSERVE_TEST_STEP_GATE"):
    _install(os.environ["TFSERVE_TEST_STEP_GATE"])
'''


class ProcessGate:
    """Holds the decoder steps of server subprocesses, as Gate does in process.

        with ProcessGate() as gate:
            process = ServerProcess(args, gate=gate)
            gate.hold()       # from now on each process waits before its next decoder step
            ...               # requests sent now stay in flight: queued or decoding
            gate.release()    # every step goes through again

    The server under test is the real `python -m tfserve serve`: the gate comes in through a
    sitecustomize module on PYTHONPATH, which wraps the runtime's decoder step in each process,
    --workers included; without hold() a step only checks that the gate's socket does not
    exist.
    """

    def __init__(self) -> None:
        # in a short directory of its own: an AF_UNIX path holds at most 107 bytes
        self.directory = Path(tempfile.mkdtemp(prefix="tfserve-gate-"))
        (self.directory / "sitecustomize.py").write_text(_GATE_SITECUSTOMIZE)
        self.path = self.directory / "gate"
        self._listener: socket.socket | None = None
        self._held: list[socket.socket] = []

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join([str(self.directory), str(ROOT)]),
                "TFSERVE_TEST_STEP_GATE": str(self.path)}

    def hold(self) -> None:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(self.path))
        listener.listen(64)
        self._listener = listener

    def wait_held(self, timeout: float = 60.0) -> int:
        """Wait until a process is held before a decoder step; its pid."""
        assert self._listener is not None, "hold() first"
        self._listener.settimeout(timeout)
        connection, _ = self._listener.accept()
        self._held.append(connection)
        connection.settimeout(timeout)
        return int(connection.makefile().readline())

    def release(self) -> None:
        """Let every held step go on, and the later ones through."""
        if self._listener is not None:
            self.path.unlink(missing_ok=True)  # later steps go straight through
            self._listener.close()  # connections not accepted yet are refused: they go on
            self._listener = None
        for connection in self._held:
            connection.close()
        self._held.clear()

    def __enter__(self) -> ProcessGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        shutil.rmtree(self.directory, ignore_errors=True)


class ServerProcess:
    """`python -m tfserve serve ...` in a subprocess; the port is read from its 'serving' log.
    With a ProcessGate, its decoder steps can be held (ProcessGate.hold)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None,
                 gate: ProcessGate | None = None) -> None:
        full_env = dict(os.environ, PYTHONPATH=str(ROOT))
        full_env.update(gate.env() if gate is not None else {})
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tfserve", "serve", *argv, "--log-level", "info",
             "--log-format", "json"],
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._changed = threading.Condition()  # notified on every line read
        self.port = 0
        self.http_port = 0  # from the 'serving' record, with --http-port
        self.serving = 0  # 'serving' records so far: one per worker with --workers
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                record = json.loads(line)
            except ValueError:
                record = {}
            with self._changed:
                self.lines.append(line)
                if record.get("event") == "serving":
                    self.port = int(record["port"])
                    self.http_port = int(record.get("http_port", 0))
                    self.serving += 1
                self._changed.notify_all()
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    closed = False

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool],
                 timeout: float = 60.0) -> dict[str, Any]:
        """The first log record matching predicate, waiting for the lines as they come."""
        return self.wait_for_all(predicate, 1, timeout)[0]

    def wait_for_all(self, predicate: Callable[[dict[str, Any]], bool], count: int,
                     timeout: float = 60.0) -> list[dict[str, Any]]:
        """The first `count` log records matching predicate, waiting for the lines as they
        come (one 'draining' record per worker, say)."""
        found: list[dict[str, Any]] = []
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if predicate(record):
                        found.append(record)
                        if len(found) == count:
                            return found
                seen = len(self.lines)
                if self.closed or not self._changed.wait(timeout):
                    raise RuntimeError(f"{len(found)} of {count} such log records:\n"
                                       + "".join(self.lines[-30:]))

    def wait_serving(self, timeout: float = 60.0, workers: int = 1) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: self.serving >= workers or self.closed,
                                          timeout) or self.serving < workers:
                raise RuntimeError("server did not start:\n" + "".join(self.lines[-30:]))
        return f"127.0.0.1:{self.port}"

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
