"""A model's files as clients and the server see them when they are broken or misplaced.

- Broken files (a truncated graph, truncated external data, an unreadable model.json): the
  error a client gets over gRPC and HTTP (Translate, GetModelInfo, ListModels' last error)
  names the file relative to the model repository (`torn/encoder.onnx`), never the
  server's own path; the server's log keeps the full path.
- Special token ids: model.json's `special_tokens` (pad, eos, unk, decoder_start) must lie in
  the vocabulary and agree with the model's ids; Manifest.load, Runtime and a server refuse
  one that does not, naming the field and the vocabulary size.
- model.json itself is confined to its model's directory like the files it names: a
  symbolic link to a file outside is refused (`--model DIR`, `--model-repository`, without
  reading it), a link to a file inside the directory loads.

The servers run on loopback threads over the session's exported random model
(conftest.random_model); every wait is for a state.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_helpers import (
    ServerThread,
    free_port,
    http_json,
    repository_args,
    server_args,
    tfserve_records,
)

from tfserve.artifacts.manifest import Manifest, ManifestError
from tfserve.client import Client, ServerError

# special_tokens' keys and the model fields they repeat
SPECIAL_FIELDS = {"pad": "pad_token_id", "eos": "eos_token_id", "unk": "unk_token_id",
                  "decoder_start": "decoder_start_token_id"}
VOCAB_SIZE = 111  # the random model's vocabulary (the demo's tokenizer)


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture,
           monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    return tfserve_records(caplog, monkeypatch)


def edit_manifest(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "model.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    change(manifest)
    path.write_text(json.dumps(manifest), encoding="utf-8")


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def model_args(directory: Path, *extra: str) -> list[str]:
    """Flags for a test server of one model (`--model DIR`), HTTP on."""
    return server_args(directory, "--http-port", str(free_port()), *extra)


def assert_refused_at_load(directory: Path, message: str, manifest_prefix: str = "") -> None:
    """Manifest.load, Runtime and a server of the model in `directory` all refuse it, naming
    `message` (Manifest.load's after `manifest_prefix`)."""
    from tfserve.runtime import Runtime

    with pytest.raises(ManifestError) as raised:
        Manifest.load(directory)
    assert manifest_prefix + message in str(raised.value)
    with pytest.raises(ValueError) as raised:
        Runtime(directory, intra_op_threads=1)
    assert message in str(raised.value)
    with pytest.raises(ValueError) as raised:
        ServerThread(model_args(directory))
    assert message in str(raised.value)


def assert_relative(text: str, named: str, *hidden: Path) -> None:
    """`text` names the file `named` (relative) and none of the server's paths `hidden`."""
    assert named in text, text
    for path in hidden:
        for form in {str(path), str(path.resolve())}:
            assert form not in text, text


# -- item: client errors name files relative to the repository ------------------------------


def test_broken_files_are_named_relative_to_the_repository_over_grpc_and_http(
        tmp_path: Path, random_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    repository = tmp_path / "repo"
    for name in ("torn", "spilled", "unreadable"):
        shutil.copytree(random_model, repository / name)
    truncate(repository / "torn" / "encoder.onnx")
    truncate(repository / "spilled" / "encoder.onnx.data")
    truncate(repository / "unreadable" / "model.json")
    expected = {"torn": "torn/encoder.onnx", "spilled": "spilled/encoder.onnx",
                "unreadable": "unreadable/model.json"}
    with ServerThread(repository_args(repository, "--load", "lazy")) as server, \
            Client(server.target, timeout=60) as client:
        for name, named in expected.items():
            with pytest.raises(ServerError) as raised:
                client.translate(["seven"], model=name, max_new_tokens=2)
            assert raised.value.code() == grpc.StatusCode.INTERNAL
            assert raised.value.details().startswith(f"model {name!r} cannot be loaded: ")
            assert_relative(raised.value.details(), named, tmp_path)
            status, body = http_json(server, "POST", "/v1/translate",
                                {"texts": ["seven"], "model": name})
            assert status == 500 and body["error"]["code"] == "INTERNAL", body
            assert_relative(body["error"]["message"], named, tmp_path)
        # described from its files without loading: model.json cannot be read
        with pytest.raises(ServerError) as raised:
            client.model_info(model="unreadable")
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert_relative(raised.value.details(), "unreadable/model.json", tmp_path)
        status, body = http_json(server, "GET", "/v1/models/unreadable")
        assert status == 500 and body["error"]["code"] == "INTERNAL", body
        assert_relative(body["error"]["message"], "unreadable/model.json", tmp_path)
        # ListModels' last error, both transports
        errors = {entry.name: entry.last_error for entry in client.list_models()}
        status, body = http_json(server, "GET", "/v1/models")
        assert status == 200
        listed = {model["name"]: model["lastError"] for model in body["models"]}
        for name, named in expected.items():
            assert_relative(errors[name], named, tmp_path)
            assert listed[name] == errors[name]
    # the server's own log keeps the full path
    assert str(repository / "torn" / "encoder.onnx") in caplog.text


def test_a_broken_model_dir_is_named_after_the_model(tmp_path: Path, random_model: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """`--model DIR` is a repository of one: the model's files are named under its name."""
    directory = tmp_path / "served" / "en-de"
    shutil.copytree(random_model, directory)
    truncate(directory / "decoder.onnx")
    with ServerThread(model_args(directory, "--load", "lazy")) as server, \
            Client(server.target, timeout=60) as client:
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"], max_new_tokens=2)
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert_relative(raised.value.details(), "en-de/decoder.onnx", tmp_path)
        status, body = http_json(server, "POST", "/v1/translate", {"texts": ["seven"]})
        assert status == 500, body
        assert_relative(body["error"]["message"], "en-de/decoder.onnx", tmp_path)
    assert str(directory / "decoder.onnx") in caplog.text


# -- item: special token ids inside the vocabulary ------------------------------------------


@pytest.mark.parametrize("key", list(SPECIAL_FIELDS))
def test_special_token_outside_the_vocabulary_is_refused_at_load(
        key: str, tmp_path: Path, random_model: Path) -> None:
    directory = tmp_path / "model"
    shutil.copytree(random_model, directory)
    edit_manifest(directory, lambda m: m["special_tokens"].update({key: 999}))
    message = f"special_tokens.{key} is 999, outside the vocabulary [0, {VOCAB_SIZE})"
    assert_refused_at_load(directory, message, manifest_prefix="model.json: ")


@pytest.mark.parametrize("value", [-1, "1", True, None])
def test_special_token_that_is_not_an_id_is_refused(value: object, tmp_path: Path,
                                                    random_model: Path) -> None:
    directory = tmp_path / "model"
    shutil.copytree(random_model, directory)
    edit_manifest(directory, lambda m: m["special_tokens"].update(eos=value))
    with pytest.raises(ManifestError) as raised:
        Manifest.load(directory)
    assert f"special_tokens.eos is {value!r}" in str(raised.value)
    assert f"[0, {VOCAB_SIZE})" in str(raised.value)


def test_special_token_that_disagrees_with_the_model_is_refused(tmp_path: Path,
                                                                random_model: Path) -> None:
    """special_tokens repeats the model's ids for other readers of model.json: an id in the
    vocabulary that is not the model's would tell them another token than the one served."""
    directory = tmp_path / "model"
    shutil.copytree(random_model, directory)
    served = Manifest.load(random_model).config.eos_token_id
    edit_manifest(directory, lambda m: m["special_tokens"].update(eos=served + 5))
    with pytest.raises(ManifestError) as raised:
        Manifest.load(directory)
    assert (f"special_tokens.eos is {served + 5}, but model.eos_token_id is {served}"
            in str(raised.value))


def test_a_repository_model_with_a_special_token_outside_is_refused(
        tmp_path: Path, random_model: Path) -> None:
    repository = tmp_path / "repo"
    shutil.copytree(random_model, repository / "alpha")
    edit_manifest(repository / "alpha", lambda m: m["special_tokens"].update(eos=999))
    with ServerThread(repository_args(repository)) as server, \
            Client(server.target, timeout=60) as client:
        with pytest.raises(ServerError) as raised:
            client.translate(["seven"], model="alpha", max_new_tokens=2)
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert (f"alpha/model.json: special_tokens.eos is 999, outside the vocabulary "
                f"[0, {VOCAB_SIZE})") in raised.value.details()


# -- item: model.json confined to its directory ---------------------------------------------


def link_manifest_outside(directory: Path, outside: Path) -> None:
    """Replace directory/model.json by a link to a copy at `outside`, named "outside"."""
    data = json.loads((directory / "model.json").read_text(encoding="utf-8"))
    data["model"]["name"] = "outside"
    outside.write_text(json.dumps(data), encoding="utf-8")
    (directory / "model.json").unlink()
    (directory / "model.json").symlink_to(outside)


def link_manifest_inside(directory: Path) -> None:
    """Move directory/model.json to a subdirectory and link it from its place."""
    (directory / "meta").mkdir()
    (directory / "model.json").rename(directory / "meta" / "model.json")
    (directory / "model.json").symlink_to(Path("meta") / "model.json")


def test_model_json_linked_outside_a_model_dir_is_refused(tmp_path: Path,
                                                          random_model: Path) -> None:
    directory = tmp_path / "model"
    shutil.copytree(random_model, directory)
    link_manifest_outside(directory, tmp_path / "elsewhere.json")
    message = f"{directory / 'model.json'} leads outside {directory}"
    assert_refused_at_load(directory, message)


def test_model_json_linked_inside_a_model_dir_loads(tmp_path: Path,
                                                    random_model: Path) -> None:
    directory = tmp_path / "model"
    shutil.copytree(random_model, directory)
    link_manifest_inside(directory)
    assert Manifest.load(directory).config.vocab_size == VOCAB_SIZE
    with ServerThread(model_args(directory)) as server, \
            Client(server.target, timeout=60) as client:
        served = [list(h.token_ids) for h in client.translate_hypotheses(["seven"],
                                                                   max_new_tokens=4)[0]]
    from tfserve.translator import Translator

    offline = Translator(random_model, intra_op_threads=1).translate_hypotheses(
        ["seven"], max_new_tokens=4)
    assert served == [list(h.token_ids) for h in offline[0]]  # the model the link leads to


def test_model_json_linked_outside_a_repository_model_is_refused_unread(
        tmp_path: Path, random_model: Path) -> None:
    """The link is not followed: the entry shows nothing of the file it leads to (its model
    name), and requests to the model fail naming its model.json; a link inside the model's
    directory serves."""
    repository = tmp_path / "repo"
    for name in ("alpha", "beta"):
        shutil.copytree(random_model, repository / name)
    link_manifest_outside(repository / "alpha", tmp_path / "elsewhere.json")
    link_manifest_inside(repository / "beta")
    with ServerThread(repository_args(repository, "--load", "lazy")) as server, \
            Client(server.target, timeout=60) as client:
        entries = {entry.name: entry for entry in client.list_models()}
        assert entries["alpha"].model_name != "outside"
        for call in (lambda: client.translate(["seven"], model="alpha", max_new_tokens=2),
                     lambda: client.model_info(model="alpha")):
            with pytest.raises(ServerError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.INTERNAL
            assert_relative(raised.value.details(), "alpha/model.json leads outside alpha",
                            tmp_path)
        status, body = http_json(server, "GET", "/v1/models/alpha")
        assert status == 500, body
        assert_relative(body["error"]["message"], "alpha/model.json leads outside alpha",
                        tmp_path)
        assert client.translate(["seven"], model="beta", max_new_tokens=2)
        assert client.model_info(model="beta").model_name == "random-test-model"
