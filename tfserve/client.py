"""Python clients of a tfserve server: `Client` (blocking) and `AsyncClient` (asyncio).

    from tfserve.client import Client
    with Client("localhost:50051") as client:
        client.translate(["three hundred and forty-two"])            # ['trois cent quarante-deux']
        client.translate_hypotheses(["seven"], num_beams=4, num_return_sequences=2)
        for chunk in client.translate_stream(["twenty-one"]):
            print(chunk.text_delta, end="")
        client.encode(["seven"], pooling="mean", per_token=True)
        client.list_models()                                         # a repository's models
        client.translate(["seven"], model="en-fr")                   # one of them
        client.translate(["Hello."], source_language="eng_Latn",     # a multilingual model
                         target_language="fra_Latn", target_prefix="Bonjour")

Decoding options are keyword arguments named as the options of `tfserve.option_table`
(num_beams, temperature, repetition_penalty, ...); the server validates them, and options
left out (or None) take the model's generation defaults. source_language,
target_language and target_prefix are named as in `Translator.translate`; target_prefix is
one string for every text or a list with one per text. A failed call raises `ServerError` (a
RuntimeError and a grpc.RpcError) carrying the status code and the server's message.

Several replicas: every channel carries gRPC's retry policy for the read-only RPCs
(`service_config`: a call answered `UNAVAILABLE`, what a draining replica answers and what
the calls of a replica that died get, or `CANCELLED` by a server that stops, is sent again,
up to 5 attempts; a stream is not retried once
the server answered it), and a list of addresses, or `round_robin=True` with a `dns:///`
name that resolves to every replica (a Kubernetes headless Service), spreads the calls over
the replicas per call, skipping those whose gRPC health is not SERVING:

    Client(["10.0.0.5:50051", "10.0.0.6:50051"])                       # round robin
    Client("dns:///tfserve-headless.default.svc.cluster.local:50051", round_robin=True)
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tfserve import option_table
from tfserve.proto import load as load_stubs
from tfserve.translator import Encoding, Translation

pb2, pb2_grpc = load_stubs()

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ServerError(RuntimeError, grpc.RpcError):
    """A call that ended with a non-OK status."""

    def __init__(self, code: grpc.StatusCode, details: str, request_id: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self.request_id = request_id

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass
class StreamChunk:
    """One TranslateStream message: text and tokens to append to input `index`."""

    index: int
    text_delta: str
    token_ids: list[int]
    done: bool
    final: Translation | None  # the best hypothesis, on the last chunk of the input
    hypotheses: list[Translation]  # every hypothesis, on the last chunk, when several
    request_id: str


def options_message(**options: Any) -> Any:
    """Decoding options (tfserve.option_table's, by name) -> the proto message, each the
    field of its name (None: the server default)."""
    unknown = sorted(set(options) - set(option_table.names()))
    if unknown:
        raise ValueError(f"unknown decoding option(s): {', '.join(unknown)}")
    message = pb2.DecodingOptions()
    for name, value in options.items():
        if value is None:
            continue  # unset: the server default
        setattr(message, name, value)
    return message


def translate_request(texts: Sequence[str] | None = None, *, token_ids: Sequence[Sequence[int]]
                      | None = None, truncate: bool = False, request_id: str = "",
                      model: str = "", source_language: str | None = None,
                      target_language: str | None = None,
                      target_prefix: str | Sequence[str] | None = None,
                      split_sentences: bool | None = None, format: str = "",
                      **options: Any) -> Any:
    """A TranslateRequest; `model` names one of the server's models ("": its default);
    target_prefix: one for every input, or a list with one per input. split_sentences
    (None: the server's default, true) and format ("text", "html") say how each text is
    read as a document (docs/documents.md)."""
    if isinstance(texts, str):
        raise ValueError("texts must be a list of strings, not one string")
    for name, value in (("source_language", source_language),
                        ("target_language", target_language)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string (one language for the request), got "
                             f"{type(value).__name__}")
    prefixes = [target_prefix] if isinstance(target_prefix, str) else list(target_prefix or [])
    request = pb2.TranslateRequest(
        texts=list(texts or []),
        token_ids=[pb2.TokenIds(ids=list(ids)) for ids in token_ids or []],
        options=options_message(**options), truncate=truncate, request_id=request_id,
        model=model, source_language=source_language or "",
        target_language=target_language or "", target_prefix=prefixes, format=format)
    if split_sentences is not None:  # unset: the server's default
        request.split_sentences = split_sentences
    return request


def encode_request(texts: Sequence[str], pooling: str = "mean", per_token: bool = False,
                   truncate: bool = False, request_id: str = "", model: str = "",
                   source_language: str | None = None) -> Any:
    if isinstance(texts, str):
        raise ValueError("texts must be a list of strings, not one string")
    return pb2.EncodeRequest(texts=list(texts), pooling=pooling, return_hidden_states=per_token,
                             truncate=truncate, request_id=request_id, model=model,
                             source_language=source_language or "")


@dataclass
class ModelEntry:
    """One model of the server's repository (ListModels): `state` is unloaded, loading,
    loaded or failed."""

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


def _model_entries(response: Any) -> list[ModelEntry]:
    return [ModelEntry(
        name=m.name, state=pb2.ModelState.Name(m.state).removeprefix("MODEL_STATE_").lower(),
        version=m.version, loaded_version=m.loaded_version, model_name=m.model_name,
        source_language=m.source_language, target_language=m.target_language,
        memory_bytes=m.memory_bytes, in_flight=m.in_flight, last_error=m.last_error,
        is_default=m.is_default) for m in response.models]


def _translation(hypothesis: Any) -> Translation:
    return Translation(hypothesis.text, list(hypothesis.token_ids), float(hypothesis.score))


def _hypotheses(response: Any) -> list[list[Translation]]:
    return [[_translation(h) for h in t.hypotheses] for t in response.translations]


def _encodings(response: Any) -> list[Encoding]:
    out = []
    for e in response.embeddings:
        hidden = np.asarray(e.hidden_states, np.float32).reshape(-1, e.dim)  # [len or 0, D]
        out.append(Encoding(hidden, np.asarray(e.embedding, np.float32), list(e.token_ids)))
    return out


def _chunk(message: Any) -> StreamChunk:
    return StreamChunk(
        index=message.index, text_delta=message.text_delta, token_ids=list(message.token_ids),
        done=message.done, final=_translation(message.final) if message.done else None,
        hypotheses=[_translation(h) for h in message.hypotheses],
        request_id=message.request_id)


def _server_error(error: grpc.RpcError) -> ServerError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return ServerError(code, details or "")


# The RPCs sent again on a retryable status. All of tfserve.v1.Translator's are read-only (an
# answer depends on the request and the model only), so a second attempt on another replica
# is safe. gRPC commits a call, and stops retrying it, once the server has sent response
# headers: a TranslateStream is retried only until its first response (the server sends
# headers when it has queued the call), never after chunks arrived.
SERVICE = "tfserve.v1.Translator"
RETRIED_METHODS = ("Translate", "TranslateStream", "Encode", "GetModelInfo", "ListModels",
                   "Detect")
# UNAVAILABLE is what a draining replica answers, what the calls in flight on a replica that
# died get (its connection is gone; through a proxy, the proxy's 502/503 reads as
# UNAVAILABLE), and what a call gets when no replica is reachable at the moment. CANCELLED
# from the server is what gRPC answers for calls that reach a server while it stops, after
# its drain, and for calls still running when the drain's grace period ends (a call the
# client cancels itself is never retried). No other status is retried: the others are
# answers of a live server to this request.
RETRYABLE_STATUS_CODES = ("UNAVAILABLE", "CANCELLED")
RETRY_POLICY: dict[str, Any] = {
    "maxAttempts": 5,  # gRPC's ceiling; with 2+ replicas the second attempt usually lands
    "initialBackoff": "0.05s",  # each pause is random in [0, backoff]: spreads the retries
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": list(RETRYABLE_STATUS_CODES),
}
# gRPC's retry throttling: each failed attempt costs a token, each success earns 0.1, and no
# retry is sent while fewer than half of maxTokens are left, so a fleet that keeps failing
# is not sent five times its load.
RETRY_THROTTLING = {"maxTokens": 100, "tokenRatio": 0.1}


def service_config(*, retry: bool = True, round_robin: bool = False,
                   health_service: str | None = SERVICE) -> dict[str, Any]:
    """The gRPC service config of tfserve's channels (the `grpc.service_config` option).

    retry: RETRY_POLICY for RETRIED_METHODS. round_robin: gRPC's round_robin balancer (a
    connection to every address the target resolves to, calls spread per call) and, with
    health_service, client-side health checking: the channel watches each replica's
    grpc.health.v1 status of that service and sends no call to one that is not SERVING (a
    replica that started draining, or is still loading). pick_first (round_robin False)
    ignores health checking, so it is only set with round_robin.
    """
    config: dict[str, Any] = {}
    if retry:
        config["methodConfig"] = [{
            "name": [{"service": SERVICE, "method": method} for method in RETRIED_METHODS],
            "retryPolicy": RETRY_POLICY}]
        config["retryThrottling"] = RETRY_THROTTLING
    if round_robin:
        config["loadBalancingConfig"] = [{"round_robin": {}}]
        if health_service is not None:
            config["healthCheckConfig"] = {"serviceName": health_service}
    return config


def _ip_address(address: str) -> tuple[int, str]:
    """'HOST:PORT' with an IP literal host -> (IP version, the address as grpc's ipv4:/ipv6:
    target lists it); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        raise ValueError(
            f"address {address!r}: a list of addresses takes IP addresses only (one "
            "'dns:///NAME:PORT' target with round_robin=True resolves a name to every "
            "replica)") from None
    return ip.version, (f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")


def channel_target(target: str | Sequence[str]) -> str:
    """A gRPC target: one target as given ('HOST:PORT', 'dns:///NAME:PORT', ...), or several
    'IP:PORT' addresses as one 'ipv4:A,B,...' (or 'ipv6:...') target, a channel that
    connects to each of them."""
    if isinstance(target, str):
        return target
    addresses = list(target)
    if not addresses:
        raise ValueError("no server address given")
    if len(addresses) == 1:
        return addresses[0]
    parsed = [_ip_address(address) for address in addresses]
    versions = {version for version, _ in parsed}
    if len(versions) > 1:
        raise ValueError("a list of addresses is all IPv4 or all IPv6, not both")
    return f"ipv{versions.pop()}:" + ",".join(address for _, address in parsed)


def _channel_options(max_message_bytes: int, extra: Sequence[tuple[str, Any]] = (), *,
                     retry: bool = True, round_robin: bool = False) -> list[tuple[str, Any]]:
    """Message size limits, the service config (retries, balancing) and the caller's
    channel options. A caller's own "grpc.service_config" replaces tfserve's, and a caller's
    "grpc.lb_policy_name" chooses the balancer instead of round_robin."""
    names = {name for name, _ in extra}
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1 if retry else 0)]
    if "grpc.service_config" not in names:
        config = service_config(retry=retry, round_robin=round_robin
                                and "grpc.lb_policy_name" not in names)
        if config:
            options.append(("grpc.service_config", json.dumps(config)))
    return [*options, *extra]


class _Base:
    def __init__(self, target: str | Sequence[str], timeout: float | None, token: str | None,
                 root_certificates: bytes | None, tls: bool) -> None:
        self.target = channel_target(target)
        self.timeout = timeout
        self.metadata: list[tuple[str, str]] = (
            [("authorization", f"Bearer {token}")] if token else [])
        self.credentials = (grpc.ssl_channel_credentials(root_certificates)
                            if tls or root_certificates else None)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


def _round_robin(target: str | Sequence[str], round_robin: bool | None) -> bool:
    """round_robin as asked; by default on for a list of several addresses."""
    if round_robin is not None:
        return round_robin
    return not isinstance(target, str) and len(list(target)) > 1


class Client(_Base):
    """Blocking client; use as a context manager (or call close()).

    target: 'HOST:PORT', any gRPC target ('dns:///NAME:PORT'), or a list of 'IP:PORT'
    addresses of replicas. retry: the retry policy of service_config (off: every failure is
    the caller's). round_robin: spread calls over every address of the target, with
    client-side health checking (default: on for a list of several addresses).
    """

    def __init__(self, target: str | Sequence[str], timeout: float | None = None,
                 token: str | None = None, root_certificates: bytes | None = None,
                 tls: bool = False, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 options: Sequence[tuple[str, Any]] = (), retry: bool = True,
                 round_robin: bool | None = None) -> None:
        super().__init__(target, timeout, token, root_certificates, tls)
        options = _channel_options(max_message_bytes, options, retry=retry,
                                   round_robin=_round_robin(target, round_robin))
        self.channel = (grpc.secure_channel(self.target, self.credentials, options)
                        if self.credentials else grpc.insecure_channel(self.target, options))
        self.stub = pb2_grpc.TranslatorStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self.metadata)
        except grpc.RpcError as error:
            raise _server_error(error) from None

    def translate_response(self, texts: Sequence[str] | None = None, *,
                           timeout: float | None = None, **kwargs: Any) -> Any:
        """The raw TranslateResponse (kwargs as translate_request: token_ids, truncate, ...)."""
        return self._call(self.stub.Translate, translate_request(texts, **kwargs), timeout)

    def translate_hypotheses(self, texts: Sequence[str] | None = None, *,
                             timeout: float | None = None,
                             **kwargs: Any) -> list[list[Translation]]:
        """num_return_sequences hypotheses per input, in input order."""
        return _hypotheses(self.translate_response(texts, timeout=timeout, **kwargs))

    def translate(self, texts: Sequence[str] | None = None, *, timeout: float | None = None,
                  **kwargs: Any) -> list[str]:
        """The best translation per input."""
        return [h[0].text for h in self.translate_hypotheses(texts, timeout=timeout, **kwargs)]

    def translate_stream(self, texts: Sequence[str] | None = None, *,
                         timeout: float | None = None, **kwargs: Any) -> Iterator[StreamChunk]:
        """Chunks as the server sends them (inputs interleave; see StreamChunk.index)."""
        call = self.stub.TranslateStream(translate_request(texts, **kwargs),
                                         timeout=self._timeout(timeout), metadata=self.metadata)
        try:
            for message in call:
                yield _chunk(message)
        except grpc.RpcError as error:
            raise _server_error(error) from None
        finally:
            call.cancel()  # no-op when finished; frees the server's rows when we stop early

    def encode(self, texts: Sequence[str], pooling: str = "mean", per_token: bool = False,
               truncate: bool = False, *, timeout: float | None = None,
               request_id: str = "", model: str = "",
               source_language: str | None = None) -> list[Encoding]:
        """Pooled embedding (and, with per_token, hidden states [len,D]) per text."""
        request = encode_request(texts, pooling, per_token, truncate, request_id, model,
                                 source_language)
        return _encodings(self._call(self.stub.Encode, request, timeout))

    def model_info(self, timeout: float | None = None, model: str = "") -> Any:
        """The ModelInfo message of `model` ("": the default model; one not loaded is
        described from its files, not loaded)."""
        return self._call(self.stub.GetModelInfo, pb2.GetModelInfoRequest(model=model),
                          timeout)

    def detect(self, texts: Sequence[str], *, timeout: float | None = None,
               model: str = "") -> list[Any]:
        """Each text's language: Detection messages (language, confidence, and the
        model's code for it as model_language), in order."""
        if isinstance(texts, str):
            raise ValueError("texts must be a list of strings, not one string")
        request = pb2.DetectRequest(texts=list(texts), model=model)
        return list(self._call(self.stub.Detect, request, timeout).detections)

    def list_models(self, timeout: float | None = None) -> list[ModelEntry]:
        """Every model of the server's repository, loaded or not."""
        return _model_entries(self._call(self.stub.ListModels, pb2.ListModelsRequest(),
                                         timeout))

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """'SERVING', 'NOT_SERVING', ... for the whole server ("") or a service name."""
        response = self._call(self.health_stub.Check,
                              health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class AsyncClient(_Base):
    """asyncio client with Client's methods as coroutines and Client's arguments;
    `async with AsyncClient(...)`."""

    def __init__(self, target: str | Sequence[str], timeout: float | None = None,
                 token: str | None = None, root_certificates: bytes | None = None,
                 tls: bool = False, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 options: Sequence[tuple[str, Any]] = (), retry: bool = True,
                 round_robin: bool | None = None) -> None:
        super().__init__(target, timeout, token, root_certificates, tls)
        options = _channel_options(max_message_bytes, options, retry=retry,
                                   round_robin=_round_robin(target, round_robin))
        self.channel = (grpc.aio.secure_channel(self.target, self.credentials, options)
                        if self.credentials else grpc.aio.insecure_channel(self.target, options))
        self.stub = pb2_grpc.TranslatorStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=self._timeout(timeout), metadata=self.metadata)
        except grpc.RpcError as error:
            raise _server_error(error) from None

    async def translate_response(self, texts: Sequence[str] | None = None, *,
                                 timeout: float | None = None, **kwargs: Any) -> Any:
        return await self._call(self.stub.Translate, translate_request(texts, **kwargs), timeout)

    async def translate_hypotheses(self, texts: Sequence[str] | None = None, *,
                                   timeout: float | None = None,
                                   **kwargs: Any) -> list[list[Translation]]:
        return _hypotheses(await self.translate_response(texts, timeout=timeout, **kwargs))

    async def translate(self, texts: Sequence[str] | None = None, *,
                        timeout: float | None = None, **kwargs: Any) -> list[str]:
        hypotheses = await self.translate_hypotheses(texts, timeout=timeout, **kwargs)
        return [h[0].text for h in hypotheses]

    async def translate_stream(self, texts: Sequence[str] | None = None, *,
                               timeout: float | None = None,
                               **kwargs: Any) -> AsyncIterator[StreamChunk]:
        call = self.stub.TranslateStream(translate_request(texts, **kwargs),
                                         timeout=self._timeout(timeout), metadata=self.metadata)
        try:
            async for message in call:
                yield _chunk(message)
        except grpc.RpcError as error:
            raise _server_error(error) from None
        finally:
            call.cancel()

    async def encode(self, texts: Sequence[str], pooling: str = "mean", per_token: bool = False,
                     truncate: bool = False, *, timeout: float | None = None,
                     request_id: str = "", model: str = "",
                     source_language: str | None = None) -> list[Encoding]:
        request = encode_request(texts, pooling, per_token, truncate, request_id, model,
                                 source_language)
        return _encodings(await self._call(self.stub.Encode, request, timeout))

    async def model_info(self, timeout: float | None = None, model: str = "") -> Any:
        return await self._call(self.stub.GetModelInfo, pb2.GetModelInfoRequest(model=model),
                                timeout)

    async def list_models(self, timeout: float | None = None) -> list[ModelEntry]:
        return _model_entries(await self._call(self.stub.ListModels, pb2.ListModelsRequest(),
                                               timeout))

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        response = await self._call(self.health_stub.Check,
                                    health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
