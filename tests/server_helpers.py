"""Helpers for the server tests: test models, a server on a background thread, a subprocess.

A real server listens on a loopback ephemeral port; the tests talk to it with real gRPC
clients (tfserve.client, or generic stubs for health and reflection).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
    from tfserve.config import ModelConfig
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


def server_args(model: Path, *extra: str) -> list[str]:
    """Flags for a test server: loopback, ephemeral port, no metrics port, one ORT thread."""
    return ["--model", str(model), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--threads", "1", "--log-level", "warning", *extra]


class ServerThread:
    """A TranslatorServer on its own event loop in a background thread.

        with ServerThread(server_args(model, "--max-batch-size", "8")) as server:
            Client(server.target) ...
            server.scheduler.test_hook = ...
    """

    def __init__(self, argv: Sequence[str], runtime: Any | None = None) -> None:
        from tfserve.server import TranslatorServer, parse_config

        self.config = parse_config(list(argv), environ={})
        self.server = TranslatorServer(self.config, runtime)
        self.scheduler = self.server.scheduler
        self.metrics = self.server.metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

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


class ServerProcess:
    """`python -m tfserve serve ...` in a subprocess; the port is read from its 'serving' log."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tfserve", "serve", *argv, "--log-level", "info",
             "--log-format", "json"],
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._changed = threading.Condition()  # notified on every line read
        self.port = 0
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
                    self.serving += 1
                self._changed.notify_all()
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    closed = False

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool],
                 timeout: float = 60.0) -> dict[str, Any]:
        """The first log record matching predicate, waiting for the lines as they come."""
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if predicate(record):
                        return record
                seen = len(self.lines)
                if self.closed or not self._changed.wait(timeout):
                    raise RuntimeError("no such log record:\n" + "".join(self.lines[-30:]))

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
