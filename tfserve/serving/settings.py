"""Server settings: every flag of `python -m tfserve serve` is also a TFSERVE_* env var.

Each setting is declared once, as a `Setting` (name, type, default, help, range): the server's
own in SERVER_SETTINGS below, the batching ones as `SchedulerConfig` fields (their defaults,
help texts and ranges are read from there), and the model ones in MODEL_SETTINGS, which the
CLI's translate and encode take too. `ServerConfig` has one field per setting, in the order
of SERVER_SETTINGS; `parse_config` reads the command line with the environment as defaults (a
flag wins) and validates, so a bad value is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from tfserve.argparsing import OneLineParser, add_version, program_name
from tfserve.scheduler import SchedulerConfig
from tfserve.text.inputs import DEFAULT_MAX_TEXTS
from tfserve.version import __version__

ENV_PREFIX = "TFSERVE_"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
LOAD_POLICIES = ("eager", "lazy")


@dataclass(frozen=True)
class Setting:
    """One setting: the flag `--name-with-dashes`, the env var TFSERVE_NAME (server), and
    the ServerConfig field `name`."""

    name: str
    type: type  # of the value: bool, int, float, str or Path (or None, where that is the default)
    default: Any
    help: str
    limits: tuple[float, float] | None = None  # inclusive; a value outside is refused
    unset: str | None = None  # what a None default stands for, said in the help
    secret: bool = False  # the help shows *** for a value set in the environment

    @property
    def flag(self) -> str:
        return "--" + _flag(self.name)

    @property
    def argument_type(self) -> Callable[[str], Any]:
        """What argparse converts the flag's (or env var's) text with."""
        return _boolean if self.type is bool else self.type

    @property
    def annotation(self) -> Any:
        """The ServerConfig field's type."""
        return self.type if self.default is not None else self.type | None

    @property
    def server_help(self) -> str:
        """The help `serve` shows (its env var and default follow)."""
        return self.help if self.unset is None else f"{self.help}; unset: {self.unset}"


def declared_in(config: type, *names: str) -> list[Setting]:
    """Settings declared as fields of the dataclass `config` (SchedulerConfig), with their
    help text and range in the fields' metadata."""
    types = typing.get_type_hints(config)
    specs = {spec.name: spec for spec in fields(config)}
    return [Setting(name, types[name], specs[name].default, specs[name].metadata["help"],
                    specs[name].metadata.get("limits")) for name in names]


# the model a command loads: the same flags for `serve` and for the CLI's translate and encode
MODEL_SETTINGS = (
    Setting("model", Path, None, "artifacts directory from `python -m export`",
            unset="the bundled demo, exported on first use"),
    Setting("device", str, "cpu", "cpu, cuda or cuda:N"),
    Setting("threads", int, 0, "ONNX Runtime intra-op threads (0: one per core)", (0, 1024)),
)
_MODEL, _DEVICE, _THREADS = MODEL_SETTINGS

# every server setting, in the order of `serve --help`
SERVER_SETTINGS: tuple[Setting, ...] = (
    _MODEL,
    Setting("model_repository", Path, None, "serve a directory of models: each subdirectory "
            "holding an exported model (its model.json) is a model named after the "
            "subdirectory, chosen per request by its `model` field; exclusive with --model "
            "(docs/server.md, Model repository)"),
    Setting("default_model", str, "", "the model a request with an empty `model` gets "
            "(empty: the only model, when there is one)"),
    Setting("load", str, "eager", "eager: load the repository's models at start (as many as "
            "--max-loaded-models and --max-model-memory allow); lazy: load each on its first "
            "request, which waits for it"),
    Setting("max_loaded_models", int, 0, "models kept loaded at once; loading one more unloads "
            "the least recently used model without requests in flight (0: no limit)",
            (0, 100_000)),
    Setting("max_model_memory", int, 0, "bytes of models kept loaded at once, each counted for "
            "the size of its artifact files; loading over it unloads the least recently used "
            "models without requests in flight (0: no limit)", (0, 2**62)),
    Setting("repository_poll_seconds", float, 0.0, "rescan --model-repository this often: a new "
            "subdirectory becomes servable, a removed one drains and unloads, a new version "
            "(a changed model.json or file) is loaded beside the old one and swapped in once "
            "ready (0: never)", (0, 86_400)),
    Setting("host", str, "0.0.0.0", "address to listen on"),
    Setting("port", int, 50051, "gRPC port (0: pick a free one, logged at startup)", (0, 65535)),
    Setting("metrics_port", int, 9090, "Prometheus /metrics HTTP port (0 disables)",
            (0, 65535)),
    Setting("http_port", int, 8080, "HTTP/JSON API port: /v1/translate, /v1/translate:stream "
            "(server-sent events), /v1/encode, /v1/model, health probes, /metrics, the "
            "playground page (0 disables; docs/server.md, HTTP API)", (0, 65535)),
    _DEVICE,
    _THREADS,
    Setting("pack_weights", bool, True, "on CPU, let ONNX Runtime pre-pack the output "
            "projection's weight where it is the tied token table (its fastest kernel): the "
            "process then holds the packed copy, and of the table's own pages only those of "
            "the rows looked up; false reads the table itself, for slower decoder steps"),
    Setting("kv_cache", str, "auto", "how the decoder's KV cache is kept: static "
            "(preallocated per batch bucket, written in place each step), dynamic (one column "
            "longer each step), or auto (the device's choice: dynamic on CPU, where it is "
            "faster)"),
    Setting("workers", int, 1, "server processes sharing --port and --http-port, each with its "
            "own model copy, batch and interpreter lock; the kernel spreads client connections "
            "over them; --metrics-port serves all their metrics (label worker), worker i its "
            "own on --metrics-port + 1 + i (Linux; see docs/server.md)", (1, 256)),
    *declared_in(SchedulerConfig, "max_batch_size", "max_batch_tokens", "max_wait_ms",
                 "wave_wait_steps", "encode_ahead"),
    Setting("event_loop", str, "auto", "the event loop the server (gRPC and HTTP) runs on: "
            "uvloop, asyncio, or auto (uvloop when installed)"),
    *declared_in(SchedulerConfig, "max_queue"),
    Setting("max_texts_per_request", int, DEFAULT_MAX_TEXTS, "inputs per request", (1, 100_000)),
    # a document's limits (tfserve.text.documents.DocumentLimits is built from these two)
    Setting("max_document_characters", int, 1_000_000, "characters per text split into "
            "sentences (a document: split_sentences, the default), and per text of Detect",
            (1, 2**31 - 1)),
    Setting("max_document_sentences", int, 10_000, "sentences (rows of the batch) a request's "
            "documents may be split into, all its texts together", (1, 10_000_000)),
    # grpc takes a signed 32-bit length
    Setting("max_message_bytes", int, 16 * 1024 * 1024, "largest message received or sent "
            "(gRPC messages, HTTP request bodies and answers)", (1024, 2**31 - 1)),
    Setting("grace_seconds", float, 30.0,
            "on SIGTERM, how long requests in flight may take to finish", (0, 3600)),
    Setting("default_max_new_tokens", int, 0, "max_new_tokens when a request leaves it 0 (0: "
            "min(256, the model's target positions - 1))", (0, 1_000_000)),
    Setting("log_format", str, "json", "json (one object per line) or text"),
    Setting("log_level", str, "info", "debug, info, warning or error"),
    Setting("tls_cert", Path, None, "PEM certificate chain: serve TLS (needs --tls-key)"),
    Setting("tls_key", Path, None, "PEM private key for --tls-cert"),
    Setting("tls_client_ca", Path, None, "PEM CA bundle: require and verify client "
            "certificates signed by it (mutual TLS; needs --tls-cert and --tls-key)"),
    Setting("auth_token", str, None, "require `authorization: Bearer TOKEN` (gRPC metadata, HTTP "
            "header; health and the playground page are exempt); prefer --auth-token-file or the "
            "env var to keep it out of `ps`", secret=True),
    Setting("auth_token_file", Path, None, "read the bearer token of --auth-token from this file "
            "(a mounted secret; surrounding whitespace and the final newline are dropped), read "
            "once at start; exclusive with --auth-token"),
    Setting("metrics_host", str, "", "address the metrics endpoint listens on (empty: --host), "
            "e.g. 127.0.0.1 to keep metrics private while gRPC listens outside"),
    Setting("max_concurrent_streams", int, 100, "concurrent calls per client connection "
            "(HTTP/2 max concurrent streams)", (1, 100_000)),
    Setting("max_connections", int, 1000,
            "client connections the server accepts at once; more are refused", (1, 1_000_000)),
    Setting("max_connection_age_seconds", float, 0.0, "close each client connection after this "
            "long (clients reconnect and spread again over --workers and replicas; calls in "
            "flight get --grace-seconds); 0: never", (0, 86_400)),
    Setting("http_max_connections", int, 1000, "HTTP connections open at once; a connection "
            "over it is closed as soon as it is accepted (with TLS: once its handshake is done)",
            (1, 1_000_000)),
    Setting("http_header_timeout_seconds", float, 30.0, "an HTTP request's line and headers must "
            "arrive within this long of its first byte (with TLS, the handshake too), else the "
            "connection is closed", (0.01, 3600)),
    Setting("http_body_timeout_seconds", float, 60.0, "an HTTP request's body must arrive in full "
            "within this long of its headers, else the connection is closed", (0.01, 3600)),
    Setting("http_keepalive_timeout_seconds", float, 75.0, "an HTTP connection idle this long "
            "(no request since it opened or since its last answer) is closed", (0.01, 86_400)),
    Setting("otel_endpoint", str, None, "OTLP endpoint to send OpenTelemetry traces to, e.g. "
            "http://collector:4317 (needs tfserve[otel]; docs/server.md, Tracing)",
            unset="the standard OTEL_EXPORTER_OTLP_ENDPOINT; tracing is off without either"),
)

# the help text and range of each server setting, by name: what build_parser and
# ServerConfig.validate read
_HELP = {setting.name: setting.server_help for setting in SERVER_SETTINGS}
_LIMITS = {setting.name: setting.limits for setting in SERVER_SETTINGS
           if setting.limits is not None}

# ServerConfig.scheduler_config passes every SchedulerConfig field on: each is a server setting
_unplaced = {spec.name for spec in fields(SchedulerConfig)} - set(_HELP)
if _unplaced:
    raise RuntimeError(f"SchedulerConfig fields missing from SERVER_SETTINGS: {_unplaced}")

_Config = TypeVar("_Config")


def _fields_from(settings: Sequence[Setting]) -> Callable[[type[_Config]], type[_Config]]:
    """A class decorator: the class becomes a dataclass with one field per setting, in
    order, each with its declared type and default."""
    def build(cls: type[_Config]) -> type[_Config]:
        cls.__annotations__ = {setting.name: setting.annotation for setting in settings}
        for setting in settings:
            setattr(cls, setting.name, field(default=setting.default))
        return dataclass(cls)
    return build


@_fields_from(SERVER_SETTINGS)
class ServerConfig:
    """Every server setting (SERVER_SETTINGS); each is a flag `--name-with-dashes` and an env
    var TFSERVE_NAME."""

    def metrics_bind_host(self) -> str:
        """The address the metrics endpoint listens on: --metrics-host, else --host."""
        return self.metrics_host or self.host

    def scheduler_config(self) -> SchedulerConfig:
        """The batching settings, as the scheduler takes them."""
        return SchedulerConfig(**{spec.name: getattr(self, spec.name)
                                  for spec in fields(SchedulerConfig)})

    def validate(self) -> ServerConfig:
        """Every value in its range, TLS files readable, choices known; else a ValueError
        naming the flag. --auth-token-file is read here, into auth_token."""
        for name, (low, high) in _LIMITS.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and low <= value <= high):
                raise ValueError(f"--{_flag(name)} must be in [{low}, {high}], got {value!r}")
        if self.metrics_port and self.workers > 1 and self.metrics_port + self.workers > 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} with --workers {self.workers}: "
                             f"worker i serves metrics on metrics_port + 1 + i, which must be "
                             f"<= 65535")
        ports = [(flag, getattr(self, name)) for flag, name in (
            ("--port", "port"), ("--http-port", "http_port"), ("--metrics-port", "metrics_port"))]
        for index, (flag, port) in enumerate(ports):
            for other, same in ports[index + 1:]:
                if port and port == same:
                    raise ValueError(f"{flag} and {other} are both {port}: each needs a port "
                                     "of its own")
        if self.model is not None and self.model_repository is not None:
            raise ValueError("--model and --model-repository are mutually exclusive: give one "
                             "(--model DIR serves one model, --model-repository DIR a "
                             "directory of them)")
        if self.load not in LOAD_POLICIES:
            raise ValueError(f"--load must be one of {', '.join(LOAD_POLICIES)}, "
                             f"got {self.load!r}")
        if self.repository_poll_seconds and self.model_repository is None:
            raise ValueError("--repository-poll-seconds needs --model-repository")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS)")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None:
                _check_pem(f"--{_flag(name)}", Path(path))
        if self.auth_token_file is not None:
            if self.auth_token is not None:
                raise ValueError("--auth-token and --auth-token-file are mutually exclusive: "
                                 "give one")
            # the token itself from here on; the file is not read again (a second validate())
            self.auth_token, self.auth_token_file = _read_token(Path(self.auth_token_file)), None
        from tfserve.runtime.sessions import KV_CACHES

        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, "
                             f"got {self.kv_cache!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, "
                             f"got {self.event_loop!r}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"--log-format must be json or text, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"--log-level must be debug, info, warning or error, "
                             f"got {self.log_level!r}")
        return self


def _check_pem(flag: str, path: Path) -> None:
    """A readable PEM file, or ValueError naming the flag (grpc's own error is 'cannot
    listen', which names neither the file nor the problem)."""
    try:
        head = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN " not in head:
        raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")


def _read_token(path: Path) -> str:
    """The bearer token in `path` without surrounding whitespace, or ValueError naming
    --auth-token-file (and never the token: the message goes to stderr and logs)."""
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--auth-token-file {path}: cannot read it ({exc.strerror})") from None
    if not token:
        raise ValueError(f"--auth-token-file {path}: the file is empty")
    # what a client can send after `Bearer ` in one header or metadata value
    if any(byte < 0x21 or byte > 0x7E for byte in token):
        raise ValueError(f"--auth-token-file {path}: the token must be one line of printable "
                         "ASCII without spaces")
    return token.decode("ascii")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Flags with their defaults taken from TFSERVE_* env vars where set (a flag wins).

    Each help ends with its env var and, where there is one, the default in force (the env
    var's value when set); help texts are printed as written ("%" included)."""
    environ = os.environ if environ is None else environ
    parser = OneLineParser(prog=f"{program_name()} serve",
                           description="Serve an exported model over gRPC (tfserve.v1.Translator, "
                           "health, reflection) and HTTP/JSON, with Prometheus metrics. Every flag "
                           "can also be set with the env var shown; the flag wins.")
    add_version(parser, __version__)
    for setting in SERVER_SETTINGS:
        name, default, kind = setting.name, setting.default, setting.argument_type
        env = env_name(name)
        if env in environ:
            try:
                default = kind(environ[env])
            except ValueError:
                parser.error(f"{env}={environ[env]!r} is not a valid value for {setting.flag}")
        shown = "***" if setting.secret and default else default
        text = f"{_HELP[name]} [env {env}]"
        if shown is not None and shown != "":  # unset: the help says what happens then
            text += f" (default: {shown})"
        parser.add_argument(setting.flag, dest=name, type=kind, default=default, help=text)
    return parser


def add_arguments(parser: argparse.ArgumentParser, settings: Sequence[Setting]) -> None:
    """The settings as flags of another command (the CLI's translate and encode take
    MODEL_SETTINGS): their declared defaults, no env vars."""
    for setting in settings:
        text = setting.help
        if setting.unset is not None:
            text += f" (default: {setting.unset})"
        parser.add_argument(setting.flag, type=setting.argument_type, default=setting.default,
                            help=text)


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
