"""The container images and Kubernetes manifests (docker/, docs/deployment.md).

Tests marked `docker` build docker/Dockerfile with podman (or docker) and run it for real: a
container serves the demo to tfserve.client over a published loopback port, answers its
HEALTHCHECK, runs as uid 10001 without torch or compilers, serves a model mounted from the
host, and drains on SIGTERM to exit code 0. They run only with TFSERVE_DOCKER_TESTS=1 and a
working engine; `eval "$(bash docker/ci-setup.sh)"` installs podman and sets everything up:

    TFSERVE_DOCKER_TESTS=1      run them at all
    TFSERVE_DOCKER_BASE         BASE build arg (e.g. localhost/tfserve-base:bookworm, a
                                debootstrap image, where no registry can be reached)
    TFSERVE_TORCH_WHEELS        a local directory with the CPU torch wheel, mounted into the
                                build (podman only)
    TFSERVE_CONTAINER_ENGINE    podman or docker (default: the first that works)
    TFSERVE_DOCKER_IMAGE        the tag to build (default localhost/tfserve:test-cpu)

The other tests (manifests, Dockerfiles, the health-check script against a live server) need
no engine and always run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from server_helpers import ProcessGate, ServerThread, free_port, server_args

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DOCKERFILES = (DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda")
IMAGE = os.environ.get("TFSERVE_DOCKER_IMAGE", "localhost/tfserve:test-cpu")
UID = "10001"
GRPC_PORT, METRICS_PORT, HTTP_PORT = 50051, 9090, 8080
BUILD_TIMEOUT_S = 1500  # a cold build is ~3-4 min here (torch wheel, export, pip installs)
START_TIMEOUT_S = 120


# -- the engine ---------------------------------------------------------------------------------


def _engine_works(engine: str) -> bool:
    try:
        return subprocess.run([engine, "info"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_engine() -> tuple[str | None, str]:
    """(engine, why not) : podman or docker, whichever is installed and answers `info`."""
    wanted = os.environ.get("TFSERVE_CONTAINER_ENGINE")
    candidates = [wanted] if wanted else ["podman", "docker"]
    tried = []
    for name in candidates:
        if shutil.which(name) is None:
            tried.append(f"{name}: not installed")
        elif not _engine_works(name):
            tried.append(f"{name}: `{name} info` fails (no daemon or no permission?)")
        else:
            return name, ""
    return None, "; ".join(tried)


_ENGINE: tuple[str | None, str] | None = None


def engine_or_skip() -> str:
    global _ENGINE
    if os.environ.get("TFSERVE_DOCKER_TESTS") != "1":
        pytest.skip("container tests are off: set TFSERVE_DOCKER_TESTS=1 "
                    "(eval \"$(bash docker/ci-setup.sh)\" installs podman and sets it)")
    if _ENGINE is None:
        _ENGINE = find_engine()
    engine, why = _ENGINE
    if engine is None:
        pytest.skip(f"no working container engine: {why}")
    return engine


def run(engine: str, *args: str, timeout: float = 120, check: bool = False
        ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([engine, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"`{engine} {' '.join(args)}` exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def report(pytestconfig: pytest.Config, line: str) -> None:
    """Print past pytest's capture (build time and image size belong in the CI log)."""
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print(f"\n[docker] {line}", flush=True)


# -- containers -------------------------------------------------------------------------------


class Container:
    """A detached container of IMAGE; gRPC, metrics and HTTP published on 127.0.0.1 ports."""

    def __init__(self, engine: str, name: str, env: dict[str, str] | None = None,
                 extra: list[str] | None = None, args: list[str] | None = None) -> None:
        self.engine, self.name = engine, name
        env = {"TFSERVE_THREADS": "1", **(env or {})}
        env_args = [item for key, value in env.items() for item in ("-e", f"{key}={value}")]
        common = ["run", "-d", "--name", name, *env_args, *(extra or [])]
        result = run(engine, *common, "-p", f"127.0.0.1::{GRPC_PORT}",
                     "-p", f"127.0.0.1::{METRICS_PORT}", "-p", f"127.0.0.1::{HTTP_PORT}",
                     IMAGE, *(args or []))
        if result.returncode == 0:
            self.grpc_port = self._published(GRPC_PORT)
            self.metrics_port = self._published(METRICS_PORT)
            self.http_port = self._published(HTTP_PORT)
        else:  # port publishing unavailable (some sandboxes): share the host's network
            run(engine, "rm", "-f", name)
            self.grpc_port, self.metrics_port = free_port(), free_port()
            self.http_port = free_port()
            run(engine, *common, "--network", "host",
                "-e", f"TFSERVE_PORT={self.grpc_port}",
                "-e", f"TFSERVE_METRICS_PORT={self.metrics_port}",
                "-e", f"TFSERVE_HTTP_PORT={self.http_port}",
                "-e", "TFSERVE_HOST=127.0.0.1", IMAGE, *(args or []), check=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _published(self, port: int) -> int:
        out = run(self.engine, "port", self.name, str(port), check=True).stdout
        match = re.search(r":(\d+)\s*$", out.strip().splitlines()[0])
        assert match, f"cannot read the published port of {port}: {out!r}"
        return int(match.group(1))

    def state(self) -> dict[str, Any]:
        out = run(self.engine, "inspect", self.name, "--format", "{{json .State}}").stdout
        return json.loads(out) if out.strip() else {}

    def logs(self) -> str:
        result = run(self.engine, "logs", self.name)
        return result.stdout + result.stderr

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll grpc.health.v1 from the host until the server says SERVING."""
        from tfserve.client import Client

        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not self.state().get("Running", False):
                raise AssertionError(f"container {self.name} exited: {self.state()}\n"
                                     f"{self.logs()[-4000:]}")
            try:
                with Client(self.target, timeout=2) as client:
                    last = client.health("tfserve.v1.Translator")
                if last == "SERVING":
                    return
            except Exception as exc:  # not listening yet
                last = repr(exc)
            time.sleep(0.5)
        raise AssertionError(f"not SERVING after {timeout} s ({last}):\n{self.logs()[-4000:]}")

    def records(self) -> list[dict]:
        """The JSON log records the server printed so far."""
        return [json.loads(line) for line in self.logs().splitlines() if line.startswith("{")]

    def wait_logged(self, event: str, count: int = 1, timeout: float = START_TIMEOUT_S) -> None:
        """Follow the container's log (`logs --follow`) until `count` records of `event` have
        been printed; the stream ends early when the container exits. `timeout` is a safety
        net that stops following, not a synchronisation."""
        follower = subprocess.Popen([self.engine, "logs", "--follow", self.name],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        safety = threading.Timer(timeout, follower.kill)
        safety.start()
        seen = 0
        try:
            assert follower.stdout is not None
            for line in follower.stdout:
                if not line.startswith("{"):
                    continue
                try:
                    seen += json.loads(line).get("event") == event
                except json.JSONDecodeError:
                    continue
                if seen >= count:
                    return
        finally:
            safety.cancel()
            follower.kill()
            follower.wait()
        raise AssertionError(f"{seen} {event!r} records, not {count}:\n{self.logs()[-4000:]}")

    def remove(self) -> None:
        stop_now = ["-t", "0"] if self.engine == "podman" else []
        run(self.engine, "rm", "-f", *stop_now, self.name, timeout=60)


def _name(what: str) -> str:
    return f"tfserve-test-{what}-{os.getpid()}"


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> str:
    return engine_or_skip()


@pytest.fixture(scope="module")
def image(engine: str, pytestconfig: pytest.Config) -> str:
    """docker/Dockerfile built as IMAGE (the layer cache makes a rebuild quick)."""
    args = ["build", "-f", str(DOCKER / "Dockerfile"), "-t", IMAGE, "--network", "host"]
    if engine == "podman":
        args += ["--format", "docker"]  # OCI images drop HEALTHCHECK
    base = os.environ.get("TFSERVE_DOCKER_BASE")
    if base:
        args += ["--build-arg", f"BASE={base}"]
    wheels = os.environ.get("TFSERVE_TORCH_WHEELS")
    if wheels and engine == "podman":
        args += ["-v", f"{wheels}:/wheels:ro", "--build-arg", "TORCH_WHEELS=/wheels"]
    started = time.monotonic()
    result = run(engine, *args, str(ROOT), timeout=BUILD_TIMEOUT_S)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        pytest.fail(f"image build failed ({seconds:.0f} s):\n{result.stdout[-6000:]}\n"
                    f"{result.stderr[-3000:]}")
    size = int(run(engine, "image", "inspect", IMAGE, "--format", "{{.Size}}",
                   check=True).stdout.strip())
    report(pytestconfig, f"{engine} build {IMAGE}: {seconds:.0f} s, image size "
                         f"{size / 1e6:.0f} MB")
    return IMAGE


@pytest.fixture(scope="module")
def container(engine: str, image: str) -> Any:
    """The image as built (the demo), read-only root filesystem, batch size set by env var."""
    box = Container(engine, _name("demo"), env={"TFSERVE_MAX_BATCH_SIZE": "8"},
                    extra=["--read-only"])
    try:
        box.wait_serving()
        yield box
    finally:
        box.remove()


# -- the image, for real ------------------------------------------------------------------------


@pytest.mark.docker
def test_container_translates_the_demo_over_grpc(container: Container) -> None:
    from tfserve.client import Client

    with Client(container.target, timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.translate(["three hundred and forty-two", "seven"]) == [
            "trois cent quarante-deux", "sept"]
        info = client.model_info()
    assert info.model_name == "tfserve-demo-en-fr-numbers"
    assert info.limits.max_batch_size == 8  # TFSERVE_MAX_BATCH_SIZE reached the server
    assert info.device == "cpu"
    with urllib.request.urlopen(f"http://127.0.0.1:{container.metrics_port}/metrics",
                                timeout=10) as response:
        metrics = response.read().decode()
    assert 'tfserve_requests_total{code="OK",rpc="Translate"}' in metrics
    # the HTTP API, on its published port
    ask = urllib.request.Request(
        f"http://127.0.0.1:{container.http_port}/v1/translate", method="POST",
        data=json.dumps({"texts": ["twenty-one"]}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=30) as response:
        answer = json.loads(response.read())
    assert answer["translations"][0]["hypotheses"][0]["text"] == "vingt et un"


@pytest.mark.docker
def test_container_healthcheck_uses_grpc_health(engine: str, image: str,
                                                container: Container) -> None:
    config = json.loads(run(engine, "image", "inspect", image, "--format",
                            "{{json .Config.Healthcheck}}", check=True).stdout)
    assert config and config["Test"][0] == "CMD", config
    assert "healthcheck.py" in " ".join(config["Test"])
    result = run(engine, "exec", container.name, *config["Test"][1:], check=True)
    assert "tfserve.v1.Translator: SERVING" in result.stdout
    if engine == "podman":
        run(engine, "healthcheck", "run", container.name, check=True)


@pytest.mark.docker
def test_container_runs_as_non_root(engine: str, image: str, container: Container) -> None:
    user = run(engine, "image", "inspect", image, "--format", "{{.Config.User}}",
               check=True).stdout.strip()
    assert user.split(":")[0] == UID
    assert run(engine, "exec", container.name, "id", "-u", check=True).stdout.strip() == UID


@pytest.mark.docker
def test_image_has_no_torch_and_no_compilers(engine: str, image: str) -> None:
    torch = run(engine, "run", "--rm", "--no-healthcheck", "--entrypoint",
                "/opt/tfserve/bin/python", image, "-c", "import torch")
    assert torch.returncode != 0
    assert "No module named 'torch'" in torch.stderr
    compilers = run(engine, "run", "--rm", "--no-healthcheck", "--entrypoint", "sh", image,
                    "-c", "command -v gcc || command -v cc || command -v g++ || command -v c++")
    assert compilers.returncode != 0, f"a compiler in the image: {compilers.stdout}"


@pytest.mark.docker
def test_mounted_model_and_sigterm_drain(engine: str, image: str, random_model: Path) -> None:
    """A model exported on the host, mounted read-only; SIGTERM while a request is in flight
    drains: the request is answered in full, then the server exits 0.

    The server's decoder steps are held (a ProcessGate: its directory is mounted into the
    container and its sitecustomize put on PYTHONPATH) from before the request until the drain
    has begun, so the request is in flight when SIGTERM arrives on any machine."""
    from tfserve.client import Client

    with ProcessGate() as gate:
        gate.directory.chmod(0o755)  # the container's user (uid 10001) reaches the socket
        # as `python -m export` wrote it (0755 under umask 022): readable by the container's uid
        box = Container(engine, _name("mounted"),
                        env={"TFSERVE_MODEL": "/models/model",
                             "PYTHONPATH": str(gate.directory),
                             "TFSERVE_TEST_STEP_GATE": str(gate.path)},
                        extra=["-v", f"{random_model}:/models/model:ro",
                               "-v", f"{gate.directory}:{gate.directory}"])
        try:
            box.wait_serving()
            with Client(box.target, timeout=60) as client:
                assert client.model_info().model_name == "random-test-model"
                gate.hold()  # the server is idle: no step comes before the chmod
                gate.path.chmod(0o777)
                texts = [f"number {i}" for i in range(4)]
                result: dict[str, Any] = {}

                def call() -> None:
                    try:
                        result["out"] = client.translate(texts, max_new_tokens=20,
                                                         min_new_tokens=20)
                    except Exception as exc:  # reported below
                        result["error"] = exc

                worker = threading.Thread(target=call)
                worker.start()
                gate.wait_held()  # the request's first decoder step waits: it is in flight
                run(engine, "kill", "--signal", "TERM", box.name, check=True)
                box.wait_logged("draining")
                gate.release()
                worker.join(60)
            assert "error" not in result, result.get("error")
            assert len(result["out"]) == len(texts)
            run(engine, "wait", box.name, timeout=60)
            state = box.state()
            assert not state.get("Running"), "still running 60 s after SIGTERM"
            assert state.get("ExitCode") == 0, (state, box.logs()[-4000:])
            events = {record.get("event"): record for record in box.records()}
            assert "draining" in events and "stopped" in events
            assert events["draining"]["in_flight"] == 1, events["draining"]
        finally:
            box.remove()


@pytest.mark.docker
def test_mounted_model_repository(engine: str, image: str, random_model: Path,
                                  tmp_path: Path) -> None:
    """A repository of two models mounted read-only (TFSERVE_MODEL_REPOSITORY): each request
    names its model, over gRPC and over the published HTTP port; health per model."""
    from tfserve.client import Client

    repository = tmp_path / "repository"
    repository.mkdir()
    for name in ("en-de", "en-fr"):
        shutil.copytree(random_model, repository / name)
    box = Container(engine, _name("repository"),
                    env={"TFSERVE_MODEL_REPOSITORY": "/models/repository", "TFSERVE_LOAD": "lazy"},
                    extra=["-v", f"{repository}:/models/repository:ro", "--read-only"])
    try:
        box.wait_serving()
        with Client(box.target, timeout=60) as client:
            assert [(m.name, m.state) for m in client.list_models()] == [
                ("en-de", "unloaded"), ("en-fr", "unloaded")]
            assert client.health("tfserve.v1.Translator/en-fr") == "SERVING"
            answer = client.translate(["seven"], model="en-fr", max_new_tokens=3)
            assert client.model_info(model="en-fr").model == "en-fr"
        body = json.dumps({"texts": ["seven"], "model": "en-fr",
                           "options": {"maxNewTokens": 3}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{box.http_port}/v1/translate",
                                         data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            translations = json.loads(response.read())["translations"]
        assert [t["hypotheses"][0].get("text", "") for t in translations] == answer
    finally:
        box.remove()


@pytest.mark.docker
def test_workers_in_a_container_drain_on_sigterm(engine: str, image: str) -> None:
    """TFSERVE_WORKERS=2: the parent is the container's PID 1; `kill TERM` reaches both
    workers through it, and the container exits 0 after both drained."""
    from tfserve.client import Client

    box = Container(engine, _name("workers"), env={"TFSERVE_WORKERS": "2"}, extra=["--read-only"])
    try:
        box.wait_serving()
        # SO_REUSEPORT: the first worker up answers health; wait on both workers' `serving`
        # records before asking the parent's scrape to reach both
        box.wait_logged("serving", count=2)
        with Client(box.target, timeout=60) as client:
            assert client.translate(["seven", "twenty-one"]) == ["sept", "vingt et un"]
        url = f"http://127.0.0.1:{box.metrics_port}/metrics"  # the parent's: every worker
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for worker in ("0", "1"):
            assert f'tfserve_worker_up{{worker="{worker}"}} 1.0' in text, text[:2000]
        run(engine, "kill", "--signal", "TERM", box.name, check=True)
        deadline = time.monotonic() + 60
        while box.state().get("Running") and time.monotonic() < deadline:
            time.sleep(0.2)
        state = box.state()
        assert not state.get("Running") and state.get("ExitCode") == 0, (state,
                                                                         box.logs()[-4000:])
        records = box.records()
        serving = [r for r in records if r.get("event") == "serving"]
        assert sorted(r["worker"] for r in serving) == [0, 1]
        assert sum(r.get("event") == "stopped" for r in records) == 2
        assert [r["exit_codes"] for r in records
                if r.get("event") == "workers_stopped"] == [[0, 0]]
    finally:
        box.remove()


# -- no engine needed ---------------------------------------------------------------------------


def _server_env_names() -> set[str]:
    from dataclasses import fields

    from tfserve.serving.settings import ServerConfig, env_name

    return {env_name(spec.name) for spec in fields(ServerConfig)}


def _dockerfile_env(text: str) -> dict[str, str]:
    joined = re.sub(r"\\\n", " ", text)
    env: dict[str, str] = {}
    for line in joined.splitlines():
        if line.startswith("ENV "):
            for key, value in re.findall(r"(\w+)=(\S+)", line[4:]):
                env[key] = value
    return env


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(path: Path) -> None:
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("ARG BASE=") and lines[1].startswith("FROM ${BASE}"), \
        "a test substitutes BASE: the first two lines are `ARG BASE=...`, `FROM ${BASE}`"
    assert "python3 -m venv" in text
    env = _dockerfile_env(text)
    # TFSERVE_CACHE: where the bundled demo is found (tfserve.demo), served without a model
    unknown = {k for k in env if k.startswith("TFSERVE_")} - _server_env_names() - {
        "TFSERVE_CACHE"}
    assert not unknown, f"not server env vars: {unknown}"
    assert "TFSERVE_MODEL" not in env, "a default TFSERVE_MODEL would conflict with a " \
        "TFSERVE_MODEL_REPOSITORY given to `docker run`"
    assert env["TFSERVE_PORT"] == str(GRPC_PORT) and env["TFSERVE_METRICS_PORT"] == str(
        METRICS_PORT)
    assert f"EXPOSE {GRPC_PORT} {METRICS_PORT} {HTTP_PORT}" in text
    assert env["TFSERVE_HTTP_PORT"] == str(HTTP_PORT)
    assert re.search(rf"^USER {UID}:{UID}$", text, re.M)
    assert "HEALTHCHECK" in text and "healthcheck.py" in text
    assert "python -m export" in text and "tfserve.proto.build" in text
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for item in source.split():
            assert (ROOT / item).exists(), f"COPY {item}: no such path"
    final = text.rsplit("\nFROM ", 1)[1]
    assert "pip install" not in final, "the final stage copies a venv, it installs nothing"
    if path.name == "Dockerfile.cuda":
        assert env["TFSERVE_DEVICE"] == "cuda" and "onnxruntime-gpu" in text
    else:
        assert env["TFSERVE_DEVICE"] == "cpu"


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "an allow-list: ignore everything, then re-include"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert {"pyproject.toml", "proto", "tfserve", "export", "docker"} <= allowed
    assert not allowed & {".git", "artifacts", "tests", ".venv"}


def test_requirements_script_swaps_onnxruntime_for_gpu() -> None:
    script = [sys.executable, str(DOCKER / "requirements.py"), str(ROOT / "pyproject.toml")]
    base = subprocess.run(script, capture_output=True, text=True, check=True).stdout.split()
    assert any(r.startswith("onnxruntime") for r in base)
    assert not any(r.startswith(("torch", "onnx>", "onnx=")) for r in base)
    gpu = subprocess.run([*script, "--gpu", "--pin", "onnxruntime-gpu==1.31.1"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert "onnxruntime-gpu==1.31.1" in gpu
    assert not any(re.match(r"onnxruntime[<>=!~]", r) for r in gpu)


def _manifests() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _deployments(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == "Deployment"]


def test_k8s_deployments_probe_and_drain_consistently() -> None:
    docs = _manifests()
    deployments = _deployments(docs)
    assert {d["metadata"]["name"] for d in deployments} == {"tfserve", "tfserve-gpu"}
    known_env = _server_env_names()
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert str(pod["securityContext"]["runAsUser"]) == UID
        (container,) = pod["containers"]
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        assert not {k for k in env if k.startswith("TFSERVE_")} - known_env
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT, "http": HTTP_PORT}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == GRPC_PORT, probe
        assert container["readinessProbe"]["grpc"]["service"] == "tfserve.v1.Translator"
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        sleep = float(pre_stop[-1]) if pre_stop[0] == "sleep" else 0.0
        grace = float(env.get("TFSERVE_GRACE_SECONDS", 30))
        assert pod["terminationGracePeriodSeconds"] >= sleep + grace + 5, \
            "the kubelet must not SIGKILL before the server's drain grace is over"
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["limits"]["memory"]
        if deployment["metadata"]["name"] == "tfserve-gpu":
            assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
            assert env.get("TFSERVE_DEVICE") == "cuda"
        else:
            # ONNX Runtime threads = the CPU limit, not the node's core count
            assert env["TFSERVE_THREADS"] == str(resources["limits"]["cpu"])


def test_k8s_services_and_autoscaler_select_the_deployments() -> None:
    docs = _manifests()
    labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
              for d in _deployments(docs)}
    services = [doc for doc in docs if doc["kind"] == "Service"]
    headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
    assert {s["metadata"]["name"] for s in headless} >= {"tfserve-headless"}
    for service in services:
        selector = service["spec"]["selector"]
        assert any(selector.items() <= pod.items() for pod in labels.values()), service
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["port"] == GRPC_PORT and grpc_port["targetPort"] == "grpc"
    for hpa in (doc for doc in docs if doc["kind"] == "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in labels
        assert hpa["spec"]["minReplicas"] >= 2
    kustomization = next(doc for doc in docs if doc.get("kind") == "Kustomization")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource


def test_healthcheck_script_against_a_live_server(random_model: Path) -> None:
    script = [sys.executable, str(DOCKER / "healthcheck.py"), "--timeout", "5"]
    env = dict(os.environ, TFSERVE_HOST="127.0.0.1")
    env.pop("TFSERVE_TLS_CERT", None)
    with ServerThread(server_args(random_model)) as server:
        port = str(server.port)
        ok = subprocess.run([*script, "--port", port], capture_output=True, text=True,
                            env=env, timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert "tfserve.v1.Translator: SERVING" in ok.stdout
        whole = subprocess.run([*script, "--port", port, "--service", ""],
                               capture_output=True, text=True, env=env, timeout=60)
        assert whole.returncode == 0, whole.stderr
        from tfserve.frontends.grpc_server import GrpcServer

        server.run_on_loop(server.front_end(GrpcServer).health.enter_graceful_shutdown)
        draining = subprocess.run([*script, "--port", port], capture_output=True, text=True,
                                  env=env, timeout=60)
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout
    gone = subprocess.run([*script, "--port", port, "--timeout", "1"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert gone.returncode == 1 and "unhealthy" in gone.stderr


def test_healthcheck_script_over_tls(random_model: Path, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    env = dict(os.environ, TFSERVE_HOST="127.0.0.1", TFSERVE_TLS_CERT=str(cert))
    with ServerThread(server_args(random_model, "--tls-cert", str(cert), "--tls-key", str(key),
                                  "--auth-token", "secret")) as server:
        ok = subprocess.run([sys.executable, str(DOCKER / "healthcheck.py"), "--port",
                             str(server.port)], capture_output=True, text=True, env=env,
                            timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "SERVING" in ok.stdout


def test_round_robin_spreads_calls_over_replicas(random_model: Path) -> None:
    """Why docs/deployment.md says L4 balancing is not enough: one channel, two replicas."""
    import grpc

    from tfserve.client import pb2_grpc, translate_request

    def served(servers: tuple[ServerThread, ...]) -> list[float]:
        return [s.metrics.registry.get_sample_value(
            "tfserve_requests_total", {"rpc": "Translate", "code": "OK"}) or 0.0
            for s in servers]

    with ServerThread(server_args(random_model)) as a, \
            ServerThread(server_args(random_model)) as b:
        target = f"ipv4:{a.target},{b.target}"  # what DNS gives for a headless Service
        request = translate_request(["seven"], max_new_tokens=2)
        for policy in ("pick_first", "round_robin"):
            with grpc.insecure_channel(target,
                                       options=[("grpc.lb_policy_name", policy)]) as channel:
                stub = pb2_grpc.TranslatorStub(channel)
                if policy == "round_robin":
                    # until both connections are up, calls go to the one that is: call until
                    # both replicas have answered one (a state, not a time)
                    first = served((a, b))
                    for _ in range(1000):
                        stub.Translate(request, timeout=30)
                        if min(after - before for after, before in zip(served((a, b)), first)):
                            break
                before = served((a, b))
                for _ in range(8):
                    stub.Translate(request, timeout=30)
            calls = [after - first for after, first in zip(served((a, b)), before)]
            if policy == "pick_first":  # gRPC's default: one connection, one replica
                assert sorted(calls) == [0, 8], calls
            else:  # both connections up: the calls alternate
                assert calls == [4, 4], calls
