"""The KServe manifests (docker/kserve/*.yaml) against KServe's CRD schemas, offline.

Every document is validated with jsonschema against the openAPIV3Schema of its
CustomResourceDefinition, vendored in tests/data/kserve/ (excerpts of KServe's own files; the
README there says which commit), the way the API server reads a structural schema: a property
that the schema does not list is an error (kubectl's default strict field validation), unless
the node says x-kubernetes-preserve-unknown-fields. Then what no schema says: the runtime's
container args (with the InferenceService's env and name filled in, as KServe does) parse as
`tfserve serve` flags with tfserve's own parser, its ports, probes and metrics annotation are
the ones those flags open and routes the HTTP API serves, images match the Dockerfiles' user
and entrypoint, and each InferenceService names a model format and protocol that a runtime
here supports. Nothing here talks to a cluster.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from jsonschema import Draft7Validator

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "docker" / "kserve"
CRD_DIR = ROOT / "tests" / "data" / "kserve"
# the image tags the manifests use -> the Dockerfile that builds each
DOCKERFILES = {
    "tfserve:cpu": ROOT / "docker" / "Dockerfile",
    "tfserve:cuda": ROOT / "docker" / "Dockerfile.cuda",
}

GROUP = "serving.kserve.io"
MODEL_MOUNT = "/mnt/models"  # where KServe puts storageUri / pvc:// for the model container
NAME_PLACEHOLDER = "{{.Name}}"  # replaced by KServe with the InferenceService's name
# KServe's protocol names (constants.ProtocolVersion) and storage URI schemes
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}
STORAGE_SCHEMES = {"gs", "s3", "pvc", "https", "http", "hdfs", "webhdfs", "oci", "hf"}
# KServe's modes that deploy a Deployment and a Service (RawDeployment, named Standard from
# KServe 0.16); the other, Knative (Serverless), allows one container port, not http1 and h2c
DEPLOYMENT_MODES = {"RawDeployment", "Standard"}
ISVC_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # KServe's InferenceService name rule


@dataclass(frozen=True)
class Crd:
    """One served version of a vendored CustomResourceDefinition."""

    group: str
    version: str
    kind: str
    schema: dict[str, Any]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


@dataclass(frozen=True)
class Manifest:
    path: Path
    doc: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.doc.get('kind')}/{self.doc['metadata']['name']}"


def _yaml_documents(path: Path) -> Iterator[dict[str, Any]]:
    yield from (doc for doc in yaml.safe_load_all(path.read_text()) if doc)


def _load_crds() -> dict[tuple[str, str], Crd]:
    crds = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in _yaml_documents(path):
            assert doc["kind"] == "CustomResourceDefinition", path
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    crd = Crd(
                        spec["group"],
                        version["name"],
                        spec["names"]["kind"],
                        version["schema"]["openAPIV3Schema"],
                    )
                    crds[(crd.api_version, crd.kind)] = crd
    return crds


CRDS = _load_crds()
MANIFESTS = [
    Manifest(path, doc) for path in sorted(KSERVE.glob("*.yaml")) for doc in _yaml_documents(path)
]
RUNTIMES = [m for m in MANIFESTS if m.doc["kind"] == "ServingRuntime"]
SERVICES = [m for m in MANIFESTS if m.doc["kind"] == "InferenceService"]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as the API server applies a structural schema: every object with `properties`
    refuses the ones it does not list, unless it preserves unknown fields."""
    node = dict(schema)
    if "properties" in node:
        node["properties"] = {name: _strict(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            node["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _strict(node["additionalProperties"])
    if "items" in node:
        node["items"] = _strict(node["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            node[key] = [_strict(sub) for sub in node[key]]
    return node


VALIDATORS = {key: Draft7Validator(_strict(crd.schema)) for key, crd in CRDS.items()}


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """What the CRD's schema finds wrong with `doc`, one line per error ("path: message")."""
    validator = VALIDATORS[(doc.get("apiVersion"), doc.get("kind"))]
    return sorted(
        f"{'/'.join(map(str, error.absolute_path)) or '.'}: {error.message}"
        for error in validator.iter_errors(doc)
    )


def _settings() -> Any:
    """tfserve's own `serve` settings: tfserve.serving.settings (tfserve.settings before the
    modules moved into packages)."""
    try:
        from tfserve.serving import settings
    except ImportError:
        from tfserve import settings  # type: ignore[no-redef]
    return settings


def _container(runtime: Manifest) -> dict[str, Any]:
    containers = runtime.doc["spec"]["containers"]
    assert [c["name"] for c in containers] == ["kserve-container"], runtime.id
    return containers[0]


def _runtime_for(service: Manifest) -> Manifest:
    """The runtime KServe picks: the one `runtime` names, else an autoSelect one for the
    model format (the highest priority)."""
    model = service.doc["spec"]["predictor"]["model"]
    name = model.get("runtime")
    candidates = [
        r
        for r in RUNTIMES
        if name in (None, r.doc["metadata"]["name"])
        and _supports(r, model["modelFormat"], auto=name is None)
    ]
    assert candidates, f"{service.id}: no runtime here supports {model['modelFormat']}" + (
        f" named {name!r}" if name else " with autoSelect"
    )
    return max(
        candidates,
        key=lambda r: max(f.get("priority", 0) for f in r.doc["spec"]["supportedModelFormats"]),
    )


def _supports(runtime: Manifest, model_format: dict[str, str], auto: bool) -> bool:
    return any(
        f["name"] == model_format["name"]
        and model_format.get("version") in (None, f.get("version"))
        and (f.get("autoSelect", False) or not auto)
        for f in runtime.doc["spec"]["supportedModelFormats"]
    )


def _serve_config(runtime: Manifest, service: Manifest | None = None) -> Any:
    """The ServerConfig `tfserve serve` starts with in the runtime's container: its args and
    the service's appended, {{.Name}} filled in, its TFSERVE_* env as the environment."""
    container = _container(runtime)
    args = list(container.get("args", []))
    name = "example"
    if service is not None:
        name = service.doc["metadata"]["name"]
        args += service.doc["spec"]["predictor"]["model"].get("args", [])
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    settings = _settings()
    known = {settings.ENV_PREFIX + field.name.upper() for field in fields(settings.ServerConfig)}
    assert set(env) <= known, f"{runtime.id}: not tfserve settings: {sorted(set(env) - known)}"
    argv = [arg.replace(NAME_PLACEHOLDER, name) for arg in args]
    return settings.parse_config(argv, environ=env)


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _http_routes() -> dict[str, Any]:
    from tfserve.frontends.http_api import ROUTES

    return {route.operation.path: route for route in ROUTES if route.operation.method == "GET"}


# -- the vendored schemas and the documents -------------------------------------------------


def test_vendored_crds_are_kserve_servingruntime_and_inferenceservice() -> None:
    assert sorted(CRDS) == [
        (f"{GROUP}/v1alpha1", "ServingRuntime"),
        (f"{GROUP}/v1beta1", "InferenceService"),
    ]
    for crd in CRDS.values():
        assert crd.schema["type"] == "object" and "spec" in crd.schema["properties"]


def test_every_document_is_a_kserve_resource_of_a_vendored_crd() -> None:
    assert RUNTIMES and SERVICES and len(RUNTIMES) + len(SERVICES) == len(MANIFESTS)
    for manifest in MANIFESTS:
        key = (manifest.doc.get("apiVersion"), manifest.doc.get("kind"))
        assert key in CRDS, f"{manifest.id}: {key} is no vendored CRD's group/version/kind"
        assert not manifest.doc["metadata"].get("namespace"), manifest.id  # kubectl -n decides


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda m: m.id)
def test_document_validates_against_its_crd_schema(manifest: Manifest) -> None:
    assert schema_errors(manifest.doc) == []


BROKEN = [
    # (what is broken, the path, the change, what the error says)
    (
        "a port number as a string",
        ("spec", "containers", 0, "ports", 0, "containerPort"),
        "8080",
        "is not of type 'integer'",
    ),
    (
        "a misspelt field",
        ("spec", "containers", 0, "imagePullPolicyy"),
        "Always",
        "Additional properties are not allowed ('imagePullPolicyy' was unexpected)",
    ),
    (
        "a memory limit with a space",
        ("spec", "containers", 0, "resources", "limits", "memory"),
        "2 GB",
        "does not match",
    ),
    (
        "a priority below 1",
        ("spec", "supportedModelFormats", 0, "priority"),
        0,
        "is less than the minimum of 1",
    ),
    (
        "args as one string",
        ("spec", "containers", 0, "args"),
        "--port=8081",
        "is not of type 'array'",
    ),
]


@pytest.mark.parametrize("what, path, value, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_runtime_fails_validation(
    what: str, path: tuple[Any, ...], value: Any, message: str
) -> None:
    doc = copy.deepcopy(RUNTIMES[0].doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = schema_errors(doc)
    assert len(errors) == 1 and message in errors[0], (what, errors)


def test_a_broken_inferenceservice_fails_validation() -> None:
    doc = copy.deepcopy(SERVICES[0].doc)
    model = doc["spec"]["predictor"]["model"]
    model["storageURI"] = model.pop("storageUri")  # KServe's field is storageUri
    assert any("'storageURI' was unexpected" in e for e in schema_errors(doc))
    del doc["spec"]["predictor"]
    assert any("'predictor' is a required property" in e for e in schema_errors(doc))
    doc = copy.deepcopy(SERVICES[0].doc)
    doc["spec"]["predictor"]["minReplicas"] = "1"
    assert any("minReplicas: '1' is not of type 'integer'" in e for e in schema_errors(doc))


# -- what the schemas do not say ---------------------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIMES, ids=lambda m: m.id)
def test_runtime_container_serves_what_its_ports_and_probes_say(runtime: Manifest) -> None:
    container = _container(runtime)
    config = _serve_config(runtime)
    assert config.model_repository is not None and str(config.model_repository) == MODEL_MOUNT
    assert config.model is None and config.default_model == "example"
    # KServe's names: http1 first (the Service's port 80 goes to the first port), h2c for gRPC
    assert [p["name"] for p in container["ports"]] == ["http1", "h2c"]
    assert _ports(container) == {"http1": config.http_port, "h2c": config.port}
    assert config.http_port == 8080 and config.port == 8081
    annotations = runtime.doc["spec"]["annotations"]
    assert int(annotations["prometheus.kserve.io/port"]) == config.metrics_port > 0
    assert annotations["prometheus.kserve.io/path"] == "/metrics"
    routes = _http_routes()
    for probe, handler in (
        ("startupProbe", "live"),
        ("livenessProbe", "live"),
        ("readinessProbe", "ready"),
    ):
        get = container[probe]["httpGet"]
        assert get["port"] == config.http_port, probe
        route = routes.get(get["path"])
        assert route is not None, f"{probe}: the HTTP API serves no GET {get['path']}"
        assert route.handler == handler, f"{probe}: {get['path']} is the {route.handler} probe"
        assert not route.operation.secured, f"{probe}: {get['path']} needs the auth token"


@pytest.mark.parametrize("runtime", RUNTIMES, ids=lambda m: m.id)
def test_runtime_image_device_and_resources_agree(runtime: Manifest) -> None:
    container = _container(runtime)
    config = _serve_config(runtime)
    image = container["image"]
    assert image in DOCKERFILES, f"{runtime.id}: {image} is built by no Dockerfile here"
    dockerfile = DOCKERFILES[image].read_text()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M)
    assert user and entrypoint
    # args are `serve` flags because the entrypoint already says `tfserve serve`
    assert json.loads(entrypoint.group(1))[-3:] == ["-m", "tfserve", "serve"]
    security = container["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == tuple(map(int, user.groups()))
    assert security["runAsNonRoot"] is True and security["allowPrivilegeEscalation"] is False
    cuda = image == "tfserve:cuda"
    assert (config.device == "cuda") == cuda
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    gpus = limits.get("nvidia.com/gpu")
    assert (gpus is not None) == cuda and requests.get("nvidia.com/gpu") == gpus
    # ONNX Runtime threads within the CPU limit (0 would start one per core of the node)
    assert 1 <= config.threads <= int(limits["cpu"])
    protocols = runtime.doc["spec"]["protocolVersions"]
    assert set(protocols) <= PROTOCOLS and {"v2", "grpc-v2"} <= set(protocols)


@pytest.mark.parametrize("service", SERVICES, ids=lambda m: f"{m.path.name}")
def test_inferenceservice_gets_a_runtime_that_serves_it(service: Manifest) -> None:
    name = service.doc["metadata"]["name"]
    assert ISVC_NAME.fullmatch(name), name
    predictor = service.doc["spec"]["predictor"]
    model = predictor["model"]
    runtime = _runtime_for(service)
    assert model["protocolVersion"] in runtime.doc["spec"]["protocolVersions"]
    # KServe mounts storageUri / pvc:// at /mnt/models
    uri = urlparse(model["storageUri"])
    assert uri.scheme in STORAGE_SCHEMES and uri.netloc, model["storageUri"]
    # the model named like the service is the default one (the server refuses to start
    # without it), and the args parse as they will in the pod
    config = _serve_config(runtime, service)
    assert config.default_model == name and str(config.model_repository) == MODEL_MOUNT
    if len(_container(runtime)["ports"]) > 1:
        annotations = service.doc["metadata"].get("annotations", {})
        mode = annotations.get("serving.kserve.io/deploymentMode")
        assert mode in DEPLOYMENT_MODES, (
            f"{service.id}: runtime {runtime.doc['metadata']['name']} has two ports, which "
            f"Knative (KServe's Serverless mode) refuses; deploymentMode is {mode!r}"
        )
    assert predictor["minReplicas"] <= predictor["maxReplicas"]
    gpus = model.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    assert (gpus is not None) == (config.device == "cuda"), service.id


def test_inferenceservice_args_are_appended_to_the_runtimes() -> None:
    """An InferenceService's model.args come after the runtime's (KServe concatenates them),
    so its flags win: the override the runtime's comment promises."""
    service = copy.deepcopy(SERVICES[0])
    service.doc["spec"]["predictor"]["model"]["args"] = [
        "--default-model=en-fr",
        "--max-batch-size=64",
    ]
    config = _serve_config(_runtime_for(service), service)
    assert (config.default_model, config.max_batch_size) == ("en-fr", 64)
    service.doc["spec"]["predictor"]["model"]["args"] = ["--no-such-flag"]
    with pytest.raises(SystemExit):
        _serve_config(_runtime_for(service), service)
