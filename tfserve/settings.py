"""Server settings: every flag of `python -m tfserve serve` is also a TFSERVE_* env var.

`ServerConfig` holds them; `parse_config` reads the command line with the environment as
defaults (a flag wins) and validates, so a bad value is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tfserve.argparsing import OneLineParser, add_version, program_name
from tfserve.inputs import DEFAULT_MAX_TEXTS
from tfserve.scheduler import SchedulerConfig
from tfserve.version import __version__

ENV_PREFIX = "TFSERVE_"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass
class ServerConfig:
    """Every server setting; each is a flag `--name-with-dashes` and an env var TFSERVE_NAME."""

    model: Path | None = None  # None: the bundled demo, exported on first use
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9090  # 0 disables the metrics endpoint
    device: str = "cpu"
    threads: int = 0
    workers: int = 1
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_wait_ms: float = 2.0
    wave_wait_steps: int = 4
    encode_ahead: bool = False
    event_loop: str = "auto"
    max_queue: int = 256
    max_texts_per_request: int = DEFAULT_MAX_TEXTS
    max_message_bytes: int = 16 * 1024 * 1024
    grace_seconds: float = 30.0
    default_max_new_tokens: int = 0  # 0: min(256, the model's target positions - 1)
    log_format: str = "json"
    log_level: str = "info"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    auth_token: str | None = None
    metrics_host: str = ""  # "": the same address as --host
    max_concurrent_streams: int = 100
    max_connections: int = 1000
    max_connection_age_seconds: float = 0.0  # 0: connections are never closed by age

    def metrics_bind_host(self) -> str:
        """The address the metrics endpoint listens on: --metrics-host, else --host."""
        return self.metrics_host or self.host

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_batch_size=self.max_batch_size,
                               max_batch_tokens=self.max_batch_tokens,
                               max_wait_ms=self.max_wait_ms, max_queue=self.max_queue,
                               wave_wait_steps=self.wave_wait_steps,
                               encode_ahead=self.encode_ahead)

    def validate(self) -> ServerConfig:
        for name, (low, high) in _LIMITS.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and low <= value <= high):
                raise ValueError(f"--{_flag(name)} must be in [{low}, {high}], got {value!r}")
        if self.metrics_port and self.workers > 1 and self.metrics_port + self.workers > 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} with --workers {self.workers}: "
                             f"worker i serves metrics on metrics_port + 1 + i, which must be "
                             f"<= 65535")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS)")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None:
                _check_pem(f"--{_flag(name)}", Path(path))
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, "
                             f"got {self.event_loop!r}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"--log-format must be json or text, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"--log-level must be debug, info, warning or error, "
                             f"got {self.log_level!r}")
        return self


# every numeric setting and its range; a value outside is refused naming the flag
_LIMITS: dict[str, tuple[float, float]] = {
    "port": (0, 65535),
    "metrics_port": (0, 65535),
    "threads": (0, 1024),
    "workers": (1, 256),
    "max_batch_size": (1, 4096),
    "max_batch_tokens": (1, 1 << 24),
    "max_wait_ms": (0, 10_000),
    "wave_wait_steps": (0, 10_000),
    "max_queue": (1, 1_000_000),
    "max_texts_per_request": (1, 100_000),
    # grpc takes a signed 32-bit length
    "max_message_bytes": (1024, 2**31 - 1),
    "grace_seconds": (0, 3600),
    "default_max_new_tokens": (0, 1_000_000),
    "max_concurrent_streams": (1, 100_000),
    "max_connections": (1, 1_000_000),
    "max_connection_age_seconds": (0, 86_400),
}


def _check_pem(flag: str, path: Path) -> None:
    """A readable PEM file, or ValueError naming the flag (grpc's own error is 'cannot
    listen', which names neither the file nor the problem)."""
    try:
        head = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN " not in head:
        raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


_HELP = {
    "model": "artifacts directory from `python -m export`; unset: the bundled demo, "
             "exported on first use",
    "host": "address to listen on",
    "port": "gRPC port (0: pick a free one, logged at startup)",
    "metrics_port": "Prometheus /metrics HTTP port (0 disables)",
    "device": "cpu, cuda or cuda:N",
    "threads": "ONNX Runtime intra-op threads (0: one per core)",
    "workers": ("server processes sharing --port, each with its own model copy, batch and "
                "interpreter lock; the kernel spreads client connections over them; "
                "--metrics-port serves all their metrics (label worker), worker i its own on "
                "--metrics-port + 1 + i (Linux; see docs/server.md)"),
    "max_batch_size": "rows (beams and samples count one each) in the running decoder batch; "
                      "inputs per encoder run",
    "max_batch_tokens": "padded source tokens per encoder run",
    "max_wait_ms": ("how long queued inputs are gathered before joining a running batch; the "
                    "least arrivals wait for the rows that just finished"),
    "wave_wait_steps": ("decoder steps arrivals may wait for the rows that just finished to "
                        "come back (closed-loop clients finishing together rejoin as one "
                        "batch); 0: never wait for them (open-loop traffic)"),
    "encode_ahead": ("while the idle worker waits for returning rows, encode them as they "
                     "arrive (true/false; helps where the event loop has a core of its own, "
                     "costs a little where the server and its event loop share few cores)"),
    "event_loop": ("the event loop the gRPC server runs on: uvloop, asyncio, or auto (uvloop "
                   "when installed)"),
    "max_queue": "requests that may wait for the model; more get RESOURCE_EXHAUSTED",
    "max_texts_per_request": "inputs per request",
    "max_message_bytes": "largest gRPC message received or sent",
    "grace_seconds": "on SIGTERM, how long requests in flight may take to finish",
    "default_max_new_tokens": "max_new_tokens when a request leaves it 0 (0: min(256, the "
                              "model's target positions - 1))",
    "log_format": "json (one object per line) or text",
    "log_level": "debug, info, warning or error",
    "tls_cert": "PEM certificate chain: serve TLS (needs --tls-key)",
    "tls_key": "PEM private key for --tls-cert",
    "tls_client_ca": "PEM CA bundle: require and verify client certificates signed by it "
                     "(mutual TLS; needs --tls-cert and --tls-key)",
    "metrics_host": "address the metrics endpoint listens on (empty: --host), e.g. 127.0.0.1 "
                    "to keep metrics private while gRPC listens outside",
    "max_concurrent_streams": "concurrent calls per client connection (HTTP/2 max "
                              "concurrent streams)",
    "max_connections": "client connections the server accepts at once; more are refused",
    "max_connection_age_seconds": ("close each client connection after this long (clients "
                                   "reconnect and spread again over --workers and replicas; "
                                   "calls in flight get --grace-seconds); 0: never"),
    "auth_token": "require `authorization: Bearer TOKEN` metadata (health is exempt); "
                  "prefer the env var to keep it out of `ps`",
}


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Flags with their defaults taken from TFSERVE_* env vars where set (a flag wins).

    Each help ends with its env var and, where there is one, the default in force (the env
    var's value when set); help texts are printed as written ("%" included)."""
    environ = os.environ if environ is None else environ
    parser = OneLineParser(prog=f"{program_name()} serve",
                           description="Serve an exported model over gRPC (tfserve.v1.Translator, "
                           "health, reflection) with Prometheus metrics. Every flag can also be "
                           "set with the env var shown; the flag wins.")
    add_version(parser, __version__)
    defaults = ServerConfig()
    for spec in fields(ServerConfig):
        name = spec.name
        default = getattr(defaults, name)
        kind: Callable[[str], Any] = _value_type(name, default)
        env = env_name(name)
        if env in environ:
            try:
                default = kind(environ[env])
            except ValueError:
                parser.error(f"{env}={environ[env]!r} is not a valid value for --{_flag(name)}")
        shown = "***" if name == "auth_token" and default else default
        text = f"{_HELP[name]} [env {env}]"
        if shown is not None and shown != "":  # unset: the help says what happens then
            text += f" (default: {shown})"
        parser.add_argument(f"--{_flag(name)}", dest=name, type=kind, default=default,
                            help=text)
    return parser


def _value_type(name: str, default: Any) -> Callable[[str], Any]:
    if name in ("model", "tls_cert", "tls_key", "tls_client_ca"):
        return Path
    if isinstance(default, bool):
        return _boolean
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    return str


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_config(argv: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> ServerConfig:
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    config = ServerConfig(**vars(args))
    try:
        return config.validate()
    except ValueError as exc:
        parser.error(str(exc))
