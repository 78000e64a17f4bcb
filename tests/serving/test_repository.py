"""The model repository: `serve --model-repository DIR`, many models in one server.

The first part drives `ModelRepository` itself on an event loop, with models that load in
microseconds (tests/fake_backend.py behind a loader that counts its loads and can be held):
loading once under concurrent first requests, least-recently-used unloading by count and by
memory, never of a model in flight, removal, version swaps and refused versions. The second
part runs real servers on loopback over exported random models: the model chosen per request
over gRPC and HTTP, NOT_FOUND, ListModels, GetModelInfo by name, per-model metrics and health,
rescans of a changing directory, `--model DIR` as a repository of one, and a lone request to
an idle model answered while another model is saturated. Nothing waits on time: tests wait on
states (a slot's waiting requests, a metric, a gate that holds a model's decoder steps).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from fake_backend import EOS, FakeBackend
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import (
    ROOT,
    Gate,
    ServerProcess,
    ServerThread,
    export_random_model,
    http_json,
    repository_args,
    tfserve_records,
)

from tfserve.artifacts.generation_defaults import GenerationDefaults
from tfserve.client import Client, ServerError
from tfserve.generation import DecodingOptions
from tfserve.serving.model_scan import Entry, read_entry, scan
from tfserve.serving.repository import ModelRepository
from tfserve.serving.settings import parse_config
from tfserve.serving.status import ModelCapacity, ModelLoadFailed, ModelNotFound
from tfserve.telemetry.metrics import Metrics


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture,
           monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    return tfserve_records(caplog, monkeypatch)


# -- a repository on the event loop, with fake models ---------------------------------------


class FakeRuntime(FakeBackend):
    """A FakeBackend with what a served model has besides: a tokenizer, limits, a config."""

    max_source_positions = 64

    def __init__(self, entry: Entry) -> None:
        super().__init__()
        self.entry = entry
        self.tokenizer = SimpleNamespace(eos_id=EOS, decode=lambda ids: " ".join(map(str, ids)))
        self.config = SimpleNamespace(name=entry.name, source_language="en",
                                      target_language="fr", encoder_only=False)
        self.manifest = SimpleNamespace(generation_defaults=GenerationDefaults())


class Loader:
    """Loads FakeRuntimes, counting the loads by name; while `hold` is set, each load waits
    for `release()`; versions in `broken` fail to load."""

    def __init__(self) -> None:
        self.loads: dict[str, int] = {}
        self.hold = False
        self.released = threading.Event()
        self.broken: set[str] = set()

    def __call__(self, entry: Entry) -> FakeRuntime:
        if self.hold:
            self.released.wait(60)
        self.loads[entry.name] = self.loads.get(entry.name, 0) + 1
        if entry.version in self.broken:
            raise ValueError(f"{entry.path}/model.json: a broken test version")
        return FakeRuntime(entry)

    def release(self) -> None:
        self.released.set()


def write_model(directory: Path, payload: int = 100, manifest: str = "{}") -> Path:
    """A model directory as the scan sees it: a model.json and a file of `payload` bytes
    (what the model is counted for, with the manifest)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.json").write_text(manifest)
    (directory / "weights.bin").write_bytes(b"\0" * payload)
    return directory


def repository_of(directory: Path, loader: Loader, *flags: str) -> ModelRepository:
    config = parse_config(["--model-repository", str(directory), *flags], environ={})
    entries = scan(directory).entries
    return ModelRepository(config, Metrics(by_model=True), entries, loader, directory)


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for a state reached by other tasks of this loop (or threads): checked after every
    turn of the loop, with a safety net."""
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0)

    await asyncio.wait_for(wait(), 60)


def run(scenario: Callable[[], Any]) -> Any:
    return asyncio.run(scenario())


def test_scan_finds_models_named_after_their_directories(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    write_model(tmp_path / "en-de", payload=1000)
    write_model(tmp_path / "en_fr.v2", payload=10)
    write_model(tmp_path / ".en-it-incoming")  # hidden: being written, renamed in later
    write_model(tmp_path / "bad name")  # cannot be a model's name (URLs, labels)
    (tmp_path / "notes").mkdir()  # no model.json
    (tmp_path / "README").write_text("a file, not a model")
    found = scan(tmp_path)
    assert list(found.entries) == ["en-de", "en_fr.v2"]
    entry = found.entries["en-de"]
    assert entry.path == tmp_path / "en-de"
    assert entry.memory_bytes == 1000 + len("{}")  # the sizes of its files
    assert len(entry.version) == 16
    assert entry.manifest_error  # "{}" is not a manifest: its load fails with this
    assert "'bad name' is not a model name" in caplog.text


def test_a_version_is_the_manifest_and_the_files(tmp_path: Path, random_model: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(random_model, model)
    first = read_entry("m", model)
    assert first.model_name == "random-test-model" and not first.manifest_error
    assert read_entry("m", model).version == first.version  # nothing changed
    manifest = json.loads((model / "model.json").read_text())
    manifest["model"]["name"] = "renamed"
    (model / "model.json").write_text(json.dumps(manifest))
    second = read_entry("m", model)
    assert second.version != first.version and second.model_name == "renamed"
    with open(model / "source.spm", "ab") as spm:  # a file rewritten in place
        spm.write(b"\0")
    assert read_entry("m", model).version not in (first.version, second.version)


def test_concurrent_first_requests_load_a_lazy_model_once(tmp_path: Path) -> None:
    write_model(tmp_path / "a")
    loader = Loader()
    repository = repository_of(tmp_path, loader, "--load", "lazy")

    async def scenario() -> None:
        repository.load_initial()
        repository.start()
        assert repository.slots["a"].state == "unloaded" and loader.loads == {}
        loader.hold = True
        requests = [asyncio.ensure_future(repository.acquire("a")) for _ in range(6)]
        await until(lambda: repository.slots["a"].waiting == 6)  # all wait for the load
        assert repository.slots["a"].state == "loading"
        loader.release()
        models = await asyncio.gather(*requests)
        assert loader.loads == {"a": 1}
        assert all(model is models[0] for model in models) and models[0].in_flight == 6
        assert repository.metrics.value("tfserve_model_loads_total",
                                        {"model": "a", "outcome": "ok"}) == 1
        await repository.stop()

    run(scenario)


def test_least_recently_used_idle_model_is_unloaded_never_one_in_flight(tmp_path: Path) -> None:
    for name in "abc":
        write_model(tmp_path / name)
    loader = Loader()
    repository = repository_of(tmp_path, loader, "--load", "lazy", "--max-loaded-models", "2")

    async def scenario() -> None:
        repository.start()
        busy = await repository.acquire("a")  # in flight throughout, and used longest ago
        repository.release(await repository.acquire("b"))
        repository.release(await repository.acquire("c"))  # a third: one must go, `a` is busy
        assert {name for name, slot in repository.slots.items() if slot.model} == {"a", "c"}
        assert repository.slots["b"].state == "unloaded"
        assert repository.metrics.value("tfserve_model_unloads_total",
                                        {"model": "b", "reason": "lru"}) == 1
        answer = await asyncio.to_thread(busy.scheduler.translate, [[3, EOS]],
                                         DecodingOptions(max_new_tokens=4), 60)
        assert answer[0][0].token_ids  # the busy model still answers
        repository.release(busy)  # `a` is idle now, and used more recently than `c`
        await repository.acquire("b")
        assert repository.slots["c"].state == "unloaded"
        assert repository.slots["a"].model is busy
        await repository.stop()

    run(scenario)


def test_every_loaded_model_busy_refuses_the_load(tmp_path: Path) -> None:
    for name in "ab":
        write_model(tmp_path / name)
    repository = repository_of(tmp_path, Loader(), "--load", "lazy", "--max-loaded-models", "1")

    async def scenario() -> None:
        repository.start()
        busy = await repository.acquire("a")
        with pytest.raises(ModelCapacity, match="--max-loaded-models 1 is reached and every "
                           "loaded model has requests in flight"):
            await repository.acquire("b")
        assert repository.slots["a"].model is busy and repository.slots["b"].state == "unloaded"
        repository.release(busy)
        await repository.acquire("b")  # `a` is idle now: unloaded to make room
        assert repository.slots["a"].state == "unloaded"
        await repository.stop()

    run(scenario)


def test_memory_limit_unloads_by_least_recent_use(tmp_path: Path) -> None:
    write_model(tmp_path / "a", payload=998)  # 1000 bytes each, with "{}"
    write_model(tmp_path / "b", payload=998)
    write_model(tmp_path / "c", payload=1498)
    write_model(tmp_path / "huge", payload=3000)
    repository = repository_of(tmp_path, Loader(), "--load", "lazy",
                               "--max-model-memory", "2500")

    async def scenario() -> None:
        repository.start()
        for name in "ab":
            repository.release(await repository.acquire(name))
        repository.release(await repository.acquire("c"))  # 1500 more: `a` goes
        assert [name for name, slot in repository.slots.items() if slot.model] == ["b", "c"]
        assert repository.metrics.value("tfserve_model_memory_bytes", {"model": "c"}) == 1500
        assert repository.metrics.value("tfserve_model_memory_bytes", {"model": "a"}) == 0
        with pytest.raises(ModelCapacity, match="3002 bytes .* over --max-model-memory 2500"):
            await repository.acquire("huge")
        assert [name for name, slot in repository.slots.items() if slot.model] == ["b", "c"]
        await repository.stop()

    run(scenario)


def test_eager_loads_at_start_as_far_as_the_limits_allow(tmp_path: Path) -> None:
    for name in "abc":
        write_model(tmp_path / name)
    loader = Loader()
    repository = repository_of(tmp_path, loader, "--max-loaded-models", "2")
    repository.load_initial()  # before any event loop, as the server does
    assert loader.loads == {"a": 1, "b": 1}
    assert [slot.state for slot in repository.slots.values()] == ["loaded", "loaded",
                                                                  "unloaded"]


def test_failed_load_fails_its_requests_and_the_next_request_tries_again(
        tmp_path: Path) -> None:
    write_model(tmp_path / "a")
    loader = Loader()
    repository = repository_of(tmp_path, loader, "--load", "lazy")
    loader.broken.add(repository.slots["a"].entry.version)

    async def scenario() -> None:
        repository.start()
        with pytest.raises(ModelLoadFailed, match="'a' cannot be loaded: .*broken test"):
            await repository.acquire("a")
        assert repository.slots["a"].state == "failed"
        assert repository.healths() == [("a", "NOT_SERVING")]
        loader.broken.clear()
        await repository.acquire("a")
        assert repository.slots["a"].state == "loaded" and loader.loads == {"a": 2}
        await repository.stop()

    run(scenario)


def test_removed_model_takes_no_new_requests_and_unloads_after_those_in_flight(
        tmp_path: Path) -> None:
    for name in "ab":
        write_model(tmp_path / name)
    repository = repository_of(tmp_path, Loader())
    repository.load_initial()

    async def scenario() -> None:
        repository.start()
        held = await repository.acquire("b")
        shutil.rmtree(tmp_path / "b")
        await repository.rescan()
        with pytest.raises(ModelNotFound, match="'b' is not served here; the models are: a "):
            await repository.acquire("b")
        assert held in repository.resident  # draining: its request goes on
        answer = await asyncio.to_thread(held.scheduler.translate, [[3, EOS]],
                                         DecodingOptions(max_new_tokens=4), 60)
        assert answer[0][0].token_ids
        repository.release(held)
        await until(lambda: held not in repository.resident)
        assert repository.metrics.value("tfserve_model_unloads_total",
                                        {"model": "b", "reason": "removed"}) == 1
        await repository.stop()

    run(scenario)


def test_new_version_is_swapped_in_and_the_old_one_drains(tmp_path: Path) -> None:
    write_model(tmp_path / "a", manifest='{"v": 1}')
    loader = Loader()
    repository = repository_of(tmp_path, loader)
    repository.load_initial()

    async def scenario() -> None:
        repository.start()
        old = await repository.acquire("a")
        write_model(tmp_path / "a", manifest='{"v": 2}')
        await repository.rescan()
        new = repository.slots["a"].model
        assert new is not None and new is not old and new.version != old.version
        assert (await repository.acquire("a")) is new  # new requests: the new version
        assert old in repository.resident and old.retired == "replaced"
        answer = await asyncio.to_thread(old.scheduler.translate, [[3, EOS]],
                                         DecodingOptions(max_new_tokens=4), 60)
        assert answer[0][0].token_ids  # the request in flight finishes on the old version
        repository.release(old)
        await until(lambda: old not in repository.resident)
        assert repository.metrics.value("tfserve_model_unloads_total",
                                        {"model": "a", "reason": "replaced"}) == 1
        await repository.stop()

    run(scenario)


def test_broken_new_version_is_refused_and_the_old_keeps_serving(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_model(tmp_path / "a", manifest='{"v": 1}')
    loader = Loader()
    repository = repository_of(tmp_path, loader)
    repository.load_initial()

    async def scenario() -> None:
        repository.start()
        old = repository.slots["a"].model
        write_model(tmp_path / "a", manifest='{"v": "broken"}')
        broken = read_entry("a", tmp_path / "a").version
        loader.broken.add(broken)
        await repository.rescan()
        slot = repository.slots["a"]
        assert slot.model is old and slot.state == "loaded"
        assert f"version {broken} cannot be loaded" in caplog.text
        assert f"version {old.version} keeps serving" in caplog.text
        status = repository.statuses()[0]
        assert status.version == broken and status.loaded_version == old.version
        assert "broken test version" in status.last_error
        assert repository.metrics.value("tfserve_model_loads_total",
                                        {"model": "a", "outcome": "failed"}) == 1
        await repository.rescan()  # the same broken version is not tried again
        assert loader.loads == {"a": 2}
        assert (await repository.acquire("a")) is old
        await repository.stop()

    run(scenario)


# -- settings -------------------------------------------------------------------------------


def test_repository_flags_are_checked_and_named(tmp_path: Path, random_model: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.serving.core import ServingCore

    for argv, message in (
            (["--model", str(random_model), "--model-repository", str(tmp_path)],
             "--model and --model-repository are mutually exclusive"),
            (["--model-repository", str(tmp_path), "--load", "sometimes"],
             "--load must be one of eager, lazy, got 'sometimes'"),
            (["--model", str(random_model), "--repository-poll-seconds", "5"],
             "--repository-poll-seconds needs --model-repository"),
            (["--model-repository", str(tmp_path), "--max-loaded-models", "-1"],
             "--max-loaded-models must be in [0, 100000], got -1")):
        with pytest.raises(SystemExit) as exited:
            parse_config(argv, environ={})
        assert exited.value.code == 2 and message in capsys.readouterr().err
    environ = {"TFSERVE_MODEL_REPOSITORY": str(tmp_path), "TFSERVE_LOAD": "lazy",
               "TFSERVE_MAX_MODEL_MEMORY": "1000000", "TFSERVE_REPOSITORY_POLL_SECONDS": "2.5"}
    config = parse_config([], environ=environ)
    assert (config.model_repository, config.load, config.max_model_memory,
            config.repository_poll_seconds) == (tmp_path, "lazy", 1_000_000, 2.5)
    shutil.copytree(random_model, tmp_path / "en-fr")
    with pytest.raises(ValueError, match="--default-model 'en-de' is not a model of "
                       "--model-repository .*; the models are: en-fr "):
        ServingCore(parse_config(["--model-repository", str(tmp_path), "--default-model",
                                  "en-de", "--metrics-port", "0"], environ={}))
    with pytest.raises(ValueError, match="--model-repository .*nowhere: not a directory"):
        ServingCore(parse_config(["--model-repository", str(tmp_path / "nowhere")],
                                 environ={}))


# -- servers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second random model (another seed): its translations differ from random_model's."""
    return export_random_model(tmp_path_factory.mktemp("other-model") / "artifacts", seed=1)


def make_repository(directory: Path, **models: Path) -> Path:
    """A repository holding a copy of each model under its name."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, artifacts in models.items():
        shutil.copytree(artifacts, directory / name)
    return directory


def offline(artifacts: Path, texts: list[str], **options: Any) -> list[list[int]]:
    """The best hypothesis's token ids per text, from the model loaded in this process."""
    from tfserve.translator import Translator

    translator = Translator(artifacts, intra_op_threads=1)
    return [h[0].token_ids for h in translator.translate_hypotheses(texts, **options)]


def health_of(server: ServerThread, service: str) -> str:
    """The health status of `service` once its first Watch update arrives (the status it has
    now), by name."""
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=60)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_health(server: ServerThread, service: str, status: str) -> None:
    """Wait until `service`'s health is `status` (Health.Watch streams every change)."""
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for update in stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=60):
            if health_pb2.HealthCheckResponse.ServingStatus.Name(update.status) == status:
                return


def requests_total(server: ServerThread, model: str, code: str = "OK",
                   rpc: str = "Translate") -> float:
    return server.metrics.value("tfserve_requests_total",
                                {"model": model, "rpc": rpc, "code": code})


TEXTS = ["three hundred and forty-two", "seven"]


def test_each_request_chooses_its_model_over_grpc_and_http(
        tmp_path: Path, random_model: Path, other_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model, beta=other_model)
    with ServerThread(repository_args(repository)) as server, \
            Client(server.target, timeout=60) as client:
        answers = {name: [h[0].token_ids for h in client.translate_hypotheses(
            TEXTS, model=name, max_new_tokens=6)] for name in ("alpha", "beta")}
        assert answers["alpha"] == offline(random_model, TEXTS, max_new_tokens=6)
        assert answers["beta"] == offline(other_model, TEXTS, max_new_tokens=6)
        assert answers["alpha"] != answers["beta"]
        for name in ("alpha", "beta"):
            status, body = http_json(server, "POST", "/v1/translate", {
                "texts": TEXTS, "model": name, "options": {"maxNewTokens": 6}})
            assert status == 200
            assert [[int(token) for token in t["hypotheses"][0].get("tokenIds", [])]
                    for t in body["translations"]] == answers[name]
            assert requests_total(server, name) == 2  # one per transport, by model
            assert server.metrics.value("tfserve_decoder_steps_total", {"model": name}) > 0
        embeddings = {name: client.encode(["seven"], model=name)[0].embedding
                      for name in ("alpha", "beta")}
        assert (embeddings["alpha"] != embeddings["beta"]).any()
        status, body = http_json(server, "POST", "/v1/encode",
                                 {"texts": ["seven"], "model": "beta"})
        assert status == 200
        assert body["embeddings"][0]["embedding"] == pytest.approx(
            embeddings["beta"].tolist(), abs=1e-6)
        info = client.model_info(model="beta")
        listed = {entry.name: entry for entry in client.list_models()}
        assert (info.model, info.version) == ("beta", listed["beta"].version)
        status, body = http_json(server, "GET", "/v1/models/beta")
        assert status == 200 and body == json.loads(
            __import__("google.protobuf.json_format", fromlist=["x"]).MessageToJson(info))
        text = server.metrics.exposition().decode()
        assert 'tfserve_requests_total{code="OK",model="alpha",rpc="Translate"} 2.0' in text
        assert 'tfserve_model_loaded{model="beta"} 1.0' in text


def test_unknown_model_is_not_found_naming_the_models(tmp_path: Path,
                                                      random_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model, beta=random_model)
    names = "the models are: alpha, beta (ListModels, GET /v1/models)"
    with ServerThread(repository_args(repository)) as server, \
            Client(server.target, timeout=60) as client:
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"], model="gamma")
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert raised.value.details() == f"model 'gamma' is not served here; {names}"
        status, body = http_json(server, "POST", "/v1/translate", {"texts": ["seven"],
                                                              "model": "gamma"})
        assert status == 404 and body["error"] == {
            "code": "NOT_FOUND", "message": f"model 'gamma' is not served here; {names}"}
        status, body = http_json(server, "GET", "/v1/models/gamma")
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"
        with pytest.raises(ServerError) as raised:  # several models and no default
            client.translate(["seven"])
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("model is empty and this server serves 2 "
                                                 "models with no --default-model: name one")
        status, body = http_json(server, "GET", "/v1/model")
        assert status == 400 and body["error"]["code"] == "INVALID_ARGUMENT"
        assert requests_total(server, "", "NOT_FOUND") == 2  # counted, with no model
    with ServerThread(repository_args(repository, "--default-model", "beta")) as server, \
            Client(server.target, timeout=60) as client:
        assert client.model_info().model == "beta"
        assert client.translate(["seven"], max_new_tokens=2)
        assert requests_total(server, "beta") == 1
        status, body = http_json(server, "GET", "/v1/model")
        assert status == 200 and body["model"] == "beta"
        assert [entry.is_default for entry in client.list_models()] == [False, True]


def test_list_models_shows_states_and_health_follows_them(tmp_path: Path,
                                                          random_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model, beta=random_model,
                                 broken=random_model)
    (repository / "broken" / "model.json").write_text("{not json")
    from google.protobuf import json_format

    from tfserve.proto import translator_pb2 as pb2

    with ServerThread(repository_args(repository, "--load", "lazy")) as server, \
            Client(server.target, timeout=60) as client:
        assert [(e.name, e.state) for e in client.list_models()] == [
            ("alpha", "unloaded"), ("beta", "unloaded"), ("broken", "unloaded")]
        for name in ("alpha", "beta"):  # unloaded, and loadable: serving
            assert health_of(server, f"tfserve.v1.Translator/{name}") == "SERVING"
        client.translate(["seven"], model="alpha", max_new_tokens=2)
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"], model="broken")
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert raised.value.details().startswith("model 'broken' cannot be loaded: ")
        entries = {entry.name: entry for entry in client.list_models()}
        assert [entries[name].state for name in ("alpha", "beta", "broken")] == [
            "loaded", "unloaded", "failed"]
        assert entries["alpha"].model_name == "random-test-model"
        assert entries["alpha"].loaded_version == entries["alpha"].version
        assert entries["broken"].last_error and not entries["broken"].loaded_version
        wait_health(server, "tfserve.v1.Translator/broken", "NOT_SERVING")
        assert health_of(server, "tfserve.v1.Translator/alpha") == "SERVING"
        with pytest.raises(grpc.RpcError) as unknown:
            health_of(server, "tfserve.v1.Translator/gamma")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        status, body = http_json(server, "GET", "/v1/models")
        response = client.stub.ListModels(pb2.ListModelsRequest(), timeout=60)
        assert status == 200 and body == json_format.MessageToDict(response)
        assert body["models"][0]["state"] == "MODEL_STATE_LOADED"
        # the same per-model health over HTTP, by KServe's name
        assert http_json(server, "GET", "/v2/models/alpha/ready") == (
            200, {"name": "alpha", "ready": True, "state": "loaded"})
        assert http_json(server, "GET", "/v2/models/beta/ready") == (
            200, {"name": "beta", "ready": True, "state": "unloaded"})
        status, body = http_json(server, "GET", "/v2/models/broken/ready")
        assert status == 503 and body["error"]["code"] == "UNAVAILABLE"
        assert "model 'broken' is not serving: its last load failed" in body["error"]["message"]
        status, body = http_json(server, "GET", "/v2/models/gamma/ready")
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"
        assert "alpha" in body["error"]["message"]


def test_model_info_of_a_model_not_loaded_loads_nothing(tmp_path: Path,
                                                          random_model: Path) -> None:
    """GetModelInfo (gRPC, and HTTP's GET /v1/models/{name}) of a model that is not loaded is
    read from its files: it loads nothing and so unloads nothing under --max-loaded-models;
    once loaded, the same fields plus its providers. A model whose model.json cannot be read
    answers INTERNAL, loading nothing; one whose load failed is still described."""
    from google.protobuf import json_format

    repository = make_repository(tmp_path / "repo", alpha=random_model, beta=random_model,
                                 broken=random_model, torn=random_model)
    (repository / "broken" / "model.json").write_text("{not json")
    (repository / "torn" / "encoder.onnx").write_bytes(b"not a graph")  # readable manifest
    args = repository_args(repository, "--load", "lazy", "--max-loaded-models", "1")
    with ServerThread(args) as server, Client(server.target, timeout=60) as client:
        client.translate(["seven"], model="alpha", max_new_tokens=2)
        described = client.model_info(model="beta")
        status, body = http_json(server, "GET", "/v1/models/beta")
        assert status == 200 and body == json_format.MessageToDict(described)
        assert [(e.name, e.state) for e in client.list_models()] == [
            ("alpha", "loaded"), ("beta", "unloaded"), ("broken", "unloaded"),
            ("torn", "unloaded")]
        assert server.metrics.value("tfserve_model_loads_total",
                                    {"model": "beta", "outcome": "ok"}) == 0
        assert requests_total(server, "beta", rpc="GetModelInfo") == 2  # under its name
        assert (described.model, described.model_name) == ("beta", "random-test-model")
        assert described.vocab_size > 0 and not described.providers
        assert not described.kv_cache and not described.packed_weights  # known once loaded
        client.translate(["seven"], model="beta", max_new_tokens=2)  # alpha makes room
        loaded = client.model_info(model="beta")
        assert list(loaded.providers) == ["CPUExecutionProvider"]
        assert loaded.kv_cache == "dynamic" and loaded.packed_weights  # on CPU
        del loaded.providers[:]
        loaded.ClearField("kv_cache")
        loaded.ClearField("packed_weights")
        assert loaded == described
        with pytest.raises(ServerError) as raised:
            client.model_info(model="broken")
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert raised.value.details().startswith("model 'broken' cannot be loaded: ")
        # nothing was loaded for it, so nothing was unloaded to make room; nor for a
        # request to it, which fails before making room
        with pytest.raises(ServerError) as refused:
            client.translate(["seven"], model="broken")
        assert refused.value.details().startswith("model 'broken' cannot be loaded: ")
        assert [(e.name, e.state) for e in client.list_models()] == [
            ("alpha", "unloaded"), ("beta", "loaded"), ("broken", "failed"),
            ("torn", "unloaded")]
        # a model whose load failed is still described from its files (the next request
        # tries the load again)
        with pytest.raises(ServerError) as failed:
            client.translate(["seven"], model="torn")
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert client.list_models()[3].state == "failed"
        assert client.model_info(model="torn").model == "torn"


def test_concurrent_first_requests_load_the_model_once(tmp_path: Path,
                                                       random_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model, beta=random_model)
    with ServerThread(repository_args(repository, "--load", "lazy")) as server:
        models = server.repository
        released = threading.Event()
        real_loader = models.loader

        def held_loader(entry: Entry) -> Any:  # the real load, once the test lets it go
            released.wait(60)
            return real_loader(entry)

        models.loader = held_loader
        with ThreadPoolExecutor(4) as pool, Client(server.target, timeout=60) as client:
            answers = [pool.submit(client.translate, ["seven"], model="alpha", max_new_tokens=3)
                       for _ in range(4)]
            server.wait_until(lambda: models.slots["alpha"].waiting == 4)
            assert client.list_models()[0].state == "loading"
            released.set()
            assert len({tuple(answer.result(60)) for answer in answers}) == 1
        assert server.metrics.value("tfserve_model_loads_total",
                                    {"model": "alpha", "outcome": "ok"}) == 1
        assert models.slots["beta"].state == "unloaded"


def test_a_model_in_flight_is_never_unloaded_to_make_room(tmp_path: Path,
                                                          random_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model, beta=random_model)
    args = repository_args(repository, "--load", "lazy", "--max-loaded-models", "1")
    with ServerThread(args) as server, Client(server.target, timeout=60) as client, \
            ThreadPoolExecutor(1) as pool:
        client.translate(["seven"], model="alpha", max_new_tokens=2)
        alpha = server.repository.loaded("alpha")
        with Gate(alpha.scheduler) as gate:
            held = pool.submit(client.translate, ["seven"], model="alpha", max_new_tokens=4)
            gate.wait_held()  # alpha has a request decoding
            with pytest.raises(ServerError) as raised:
                client.translate(["seven"], model="beta")
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-loaded-models 1 is reached" in raised.value.details()
            assert server.repository.loaded("alpha") is alpha
        assert held.result(60)
        client.translate(["seven"], model="beta", max_new_tokens=2)  # alpha is idle now
        assert [(e.name, e.state) for e in client.list_models()] == [
            ("alpha", "unloaded"), ("beta", "loaded")]
        assert server.metrics.value("tfserve_model_unloads_total",
                                    {"model": "alpha", "reason": "lru"}) == 1


def rescan(server: ServerThread) -> None:
    """What the poller does every --repository-poll-seconds, now."""
    server.run_on_loop(server.repository.rescan, timeout=120)


def test_rescan_adds_a_model_and_swaps_a_new_version_under_requests_in_flight(
        tmp_path: Path, random_model: Path, other_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model)
    first = offline(random_model, ["seven"], max_new_tokens=4)
    second = offline(other_model, ["seven"], max_new_tokens=4)
    with ServerThread(repository_args(repository)) as server, \
            Client(server.target, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        shutil.copytree(other_model, repository / "beta")
        rescan(server)
        assert [h[0].token_ids for h in client.translate_hypotheses(
            ["seven"], model="beta", max_new_tokens=4)] == second
        wait_health(server, "tfserve.v1.Translator/beta", "SERVING")
        old = server.repository.loaded("alpha")
        with Gate(old.scheduler) as gate:
            held = pool.submit(client.translate_hypotheses, ["seven"], model="alpha",
                               max_new_tokens=4)
            gate.wait_held()  # a request decoding on the old version
            shutil.rmtree(repository / "alpha")
            shutil.copytree(other_model, repository / "alpha")
            rescan(server)  # the new version loads beside the old and is swapped in
            new = server.repository.loaded("alpha")
            assert new is not old and new.version != old.version
            assert [h[0].token_ids for h in client.translate_hypotheses(
                ["seven"], model="alpha", max_new_tokens=4)] == second
            assert client.model_info(model="alpha").version == new.version
            assert old in server.repository.resident  # still draining
        assert [h[0].token_ids for h in held.result(60)] == first  # finished on the old one
        server.wait_until(lambda: old not in server.repository.resident)
        assert server.metrics.value("tfserve_model_unloads_total",
                                    {"model": "alpha", "reason": "replaced"}) == 1


def test_rescan_removes_a_model_after_its_requests_in_flight(tmp_path: Path,
                                                             random_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model, beta=random_model)
    with ServerThread(repository_args(repository)) as server, \
            Client(server.target, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        beta = server.repository.loaded("beta")
        with Gate(beta.scheduler) as gate:
            held = pool.submit(client.translate, ["seven"], model="beta", max_new_tokens=4)
            gate.wait_held()
            shutil.rmtree(repository / "beta")
            rescan(server)
            with pytest.raises(ServerError) as raised:
                client.translate(["seven"], model="beta")
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND
            assert "the models are: alpha (" in raised.value.details()
            wait_health(server, "tfserve.v1.Translator/beta", "SERVICE_UNKNOWN")
            assert beta in server.repository.resident  # draining
        assert held.result(60)  # the request in flight finished
        server.wait_until(lambda: beta not in server.repository.resident)
        assert server.metrics.value("tfserve_model_unloads_total",
                                    {"model": "beta", "reason": "removed"}) == 1
        assert [entry.name for entry in client.list_models()] == ["alpha"]


def test_rescan_refuses_a_broken_new_version_and_the_old_keeps_serving(
        tmp_path: Path, random_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model)
    with ServerThread(repository_args(repository)) as server, \
            Client(server.target, timeout=60) as client:
        before = client.translate(["seven"], model="alpha", max_new_tokens=4)
        old = server.repository.loaded("alpha")
        (repository / "alpha" / "decoder.onnx").write_bytes(b"not an onnx graph")
        rescan(server)
        assert server.repository.loaded("alpha") is old
        assert server.metrics.value("tfserve_model_loads_total",
                                    {"model": "alpha", "outcome": "failed"}) == 1
        assert "cannot be loaded" in caplog.text and "keeps serving" in caplog.text
        entry = client.list_models()[0]
        assert entry.state == "loaded" and entry.loaded_version == old.version
        assert entry.version != old.version and entry.last_error
        assert client.translate(["seven"], model="alpha", max_new_tokens=4) == before
        assert health_of(server, "tfserve.v1.Translator/alpha") == "SERVING"


def test_the_poller_finds_a_new_model(tmp_path: Path, random_model: Path) -> None:
    repository = make_repository(tmp_path / "repo", alpha=random_model)
    args = repository_args(repository, "--repository-poll-seconds", "0.05")
    with ServerThread(args) as server, Client(server.target, timeout=60) as client:
        shutil.copytree(random_model, repository / ".beta-incoming")  # hidden while copied
        (repository / ".beta-incoming").rename(repository / "beta")
        server.wait_until(lambda: server.repository.loaded("beta") is not None)
        assert [h[0].token_ids for h in client.translate_hypotheses(
            ["seven"], model="beta", max_new_tokens=2)] == offline(random_model, ["seven"],
                                                                   max_new_tokens=2)
        assert client.model_info(model="beta").model == "beta"


def test_an_empty_repository_serves_once_a_model_is_added(tmp_path: Path,
                                                          random_model: Path) -> None:
    repository = tmp_path / "repo"
    repository.mkdir()
    with ServerThread(repository_args(repository)) as server, \
            Client(server.target, timeout=60) as client:
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"])
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert raised.value.details() == ("no model is served: the model repository "
                                          "(--model-repository) holds no model now (a "
                                          "subdirectory with a model.json)")
        assert str(repository) not in raised.value.details()  # no server path to clients
        assert client.list_models() == []
        shutil.copytree(random_model, repository / "alpha")
        rescan(server)
        assert client.translate(["seven"], max_new_tokens=2)  # the only model: the default


def test_model_dir_is_a_repository_of_one(random_model: Path) -> None:
    args = ["--model", str(random_model), "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0", "--http-port", "0", "--threads", "1", "--log-level",
            "warning"]
    name = random_model.name  # the model is named after its directory
    with ServerThread(args) as server, Client(server.target, timeout=60) as client:
        [entry] = client.list_models()
        assert (entry.name, entry.state, entry.is_default) == (name, "loaded", True)
        assert client.translate(["seven"], max_new_tokens=3) == client.translate(
            ["seven"], model=name, max_new_tokens=3)
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"], model="en-de")
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"the models are: {name} (" in raised.value.details()
        assert health_of(server, f"tfserve.v1.Translator/{name}") == "SERVING"
        # the series keep their labels: no `model` label on a --model DIR server
        assert server.metrics.value("tfserve_requests_total",
                                    {"rpc": "Translate", "code": "OK"}) == 2


def test_a_lone_request_to_an_idle_model_is_answered_while_another_is_saturated(
        tmp_path: Path, random_model: Path) -> None:
    """Fairness: each model has its own worker thread. `busy` gets 48 requests of 120 decoder
    steps each (six waves of 8 rows): long by construction. The lone request to `idle` (2
    steps) must be answered while `busy` still has requests in flight, not after them."""
    repository = make_repository(tmp_path / "repo", busy=random_model, idle=random_model)
    args = repository_args(repository, "--max-batch-size", "8")
    with ServerThread(args) as server, ThreadPoolExecutor(48) as pool, \
            Client(server.target, timeout=120) as client:
        busy = server.repository.loaded("busy")
        with Gate(busy.scheduler) as gate:  # held until all 48 are in: then it runs them
            load = [pool.submit(client.translate, ["three hundred and forty-two"],
                                model="busy", max_new_tokens=120, min_new_tokens=120)
                    for _ in range(48)]
            server.wait_until(lambda: busy.in_flight == 48)
            gate.wait_held()  # the first 8 are joined, before their first step
        assert client.translate(["seven"], model="idle", max_new_tokens=2)
        finished = requests_total(server, "busy")
        assert finished < 48, "the lone request waited for the saturated model"
        assert busy.in_flight > 0
        assert all(len(answer.result(120)) == 1 for answer in load)


def test_serve_a_repository_from_the_command_line_with_workers(
        tmp_path: Path, random_model: Path, other_model: Path) -> None:
    """`python -m tfserve serve` with TFSERVE_MODEL_REPOSITORY and --workers 2 (each worker
    serves the whole repository), asked by the CLI: `models`, `translate --model-name`."""
    repository = make_repository(tmp_path / "repo", **{"en-fr": random_model,
                                                       "en-de": other_model})
    process = ServerProcess(["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                             "--http-port", "0", "--threads", "1", "--workers", "2", "--load",
                             "lazy"], env={"TFSERVE_MODEL_REPOSITORY": str(repository)})
    try:
        target = process.wait_serving(workers=2)
        serving = [r for r in process.records() if r.get("event") == "serving"]
        assert [r["models"] for r in serving] == [["en-de", "en-fr"]] * 2
        assert [r["loaded"] for r in serving] == [[], []]  # --load lazy

        def cli(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "tfserve", *argv], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)

        listed = cli("models", "--server", target)
        assert listed.returncode == 0, listed.stderr
        entries = [json.loads(line) for line in listed.stdout.splitlines()]
        assert [(e["name"], e["model_name"]) for e in entries] == [
            ("en-de", "random-test-model"), ("en-fr", "random-test-model")]
        done = cli("translate", "--server", target, "--model-name", "en-de", "--json",
                   "--max-new-tokens", "4", "seven")
        assert done.returncode == 0, done.stderr
        assert [json.loads(done.stdout)["hypotheses"][0]["token_ids"]] == offline(
            other_model, ["seven"], max_new_tokens=4)
        refused = cli("translate", "--server", target, "--model-name", "en-it", "seven")
        assert refused.returncode == 1 and "NOT_FOUND: model 'en-it' is not served here; " \
            "the models are: en-de, en-fr" in refused.stderr
        offline_name = cli("translate", "--model-name", "en-de", "seven")
        assert offline_name.returncode == 2 and "--model-name needs --server" in \
            offline_name.stderr
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(60) == 0
    finally:
        process.kill()
