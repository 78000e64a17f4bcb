"""tfserve as pip installs it: the sdist and the wheel built from it, installed without torch.

A copy of the source tree as git sees it (no generated stubs, as in a fresh clone) is built
into an sdist, the sdist's own stubs are deleted and a wheel is built from what is left, so the
wheel's stubs come from the sdist's proto/. The wheel is then installed with its runtime
dependencies only (from the package index) into a fresh virtual environment, next to
proto-plus, whose top-level `proto` package sits in site-packages exactly where a checkout's
proto/ sits next to tfserve/ (tfserve must never take it for its own). Its site-packages is
made read-only, and when the tests run as root every command runs as `nobody`, so a write
into the install fails loudly. The same is done for an editable install of a read-only
checkout, and a source tree nobody built must fail to import the stubs without writing.

Builds run in a build environment holding pyproject.toml's [build-system].requires (the
pinned grpcio-tools), as pip's build isolation makes one; the environments get their
dependencies from pip's index (or its cache).

The generated stubs run on old runtimes too: the wheel is installed with the floor versions
of protobuf, grpcio, grpcio-health-checking and grpcio-reflection and serves, and (marked slow)
beside tritonclient and kserve, which hold protobuf below 7.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tfserve.proto import build as proto_build

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors a TOML parser
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("translator_pb2.py", "translator_pb2.pyi", "translator_pb2_grpc.py")
STUB_DIR = "tfserve/proto/tfserve/v1"
# the Open Inference Protocol's (proto/inference/grpc_service.proto)
INFERENCE_STUBS = ("grpc_service_pb2.py", "grpc_service_pb2.pyi", "grpc_service_pb2_grpc.py")
PROTO = "proto/tfserve/v1/translator.proto"
NON_ROOT_USER = "nobody"
# what the checks' subprocesses may take at most: a safety net, every wait is for a state
TIMEOUT = 300
# the same for a pip install from the index: resolving and downloading a large set of
# packages (tritonclient and kserve with theirs, or onnxruntime-gpu) over a slow network
INSTALL_TIMEOUT = 1800


# -- helpers ------------------------------------------------------------------------------------


def run(args: Sequence[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run a command; a failure shows its output."""
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def copy_source_tree(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them: tracked and untracked files that git
    does not ignore (so no generated stubs, egg-info or build/)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout (git ls-files: {listed.stderr.decode().strip()})")
    for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        source = ROOT / name
        if source.is_file():  # deleted but not yet staged files are listed too
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def build_backend(call: str, source: Path, out: Path, python: Path) -> Path:
    """setuptools.build_meta.<call>(out) in source, run by python (a build environment's).
    Every warning is an error: setuptools announces a configuration it will stop accepting (a
    TOML-table `project.license`, say) with a deprecation warning, months before the build
    breaks, and the build should fail on the day of the warning instead. Only setuptools'
    InformationOnly notices (an editable install's "meta path finder" note) are let through."""
    out.mkdir(parents=True, exist_ok=True)
    done = run([python, "-c",
                "import sys, warnings; warnings.simplefilter('error'); "
                "from setuptools.warnings import InformationOnly; "
                "warnings.simplefilter('ignore', InformationOnly); "
                "from setuptools import build_meta; "
                f"print(build_meta.{call}(sys.argv[1]))", out], cwd=source)
    return out / done.stdout.strip().splitlines()[-1]


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under root but bytecode caches."""
    out = {}
    for path in root.rglob("*"):
        if "__pycache__" not in path.parts and (path.is_file() or path.is_symlink()):
            stat = path.lstat()
            out[path.relative_to(root).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return out


def make_read_only(root: Path) -> None:
    subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)


def make_writable(root: Path) -> None:
    subprocess.run(["chmod", "-R", "u+w", str(root)], check=False)


@dataclass
class User:
    """Who runs the installed tfserve: `prefix` turns a command into that user's (empty:
    the test's own user), `python` is an interpreter that user can run (venvs are based on
    it); `other` is False where a root test process found no way to drop to a non-root user
    (`reason` says why), and then root's permissions make read-only mean little."""

    prefix: list[str]
    python: str
    other: bool
    reason: str = ""
    uid: int = -1
    gid: int = -1


def _python_as(prefix: list[str], python: str) -> str | None:
    probe = [python, "-c", "import sys, venv, ensurepip; print(sys.version, sys.prefix)"]
    try:
        done = subprocess.run(prefix + probe, capture_output=True, text=True, timeout=60,
                              cwd="/")
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def find_user() -> User:
    base = getattr(sys, "_base_executable", sys.executable)
    if os.geteuid() != 0:
        return User([], base, True, uid=os.getuid(), gid=os.getgid())
    try:
        account = pwd.getpwnam(NON_ROOT_USER)
    except KeyError:
        return User([], base, False, f"running as root and there is no {NON_ROOT_USER} user")
    if shutil.which("setpriv"):
        prefix = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}",
                  "--clear-groups"]
    elif shutil.which("runuser"):
        prefix = ["runuser", "-u", NON_ROOT_USER, "--"]
    else:
        return User([], base, False, "running as root without setpriv or runuser")
    # an interpreter that runs the same for root and for that user: a Python under /root
    # (pyenv) is not readable by others, the distribution's /usr/bin/python3 is
    candidates = dict.fromkeys(p for p in (base, sys.executable, shutil.which("python3"),
                                           "/usr/bin/python3") if p)
    for python in candidates:
        mine = _python_as([], python)
        if mine is not None and _python_as(prefix, python) == mine:
            version = tuple(int(x) for x in mine.split()[0].split(".")[:2])
            if version >= (3, 10):
                return User(prefix, python, True, uid=account.pw_uid, gid=account.pw_gid)
    return User([], base, False, f"no Python that both root and {NON_ROOT_USER} can run "
                                 f"(tried {', '.join(candidates)})")


@dataclass
class Venv:
    """A virtual environment that `user` runs commands in, from a neutral directory with a
    clean environment: nothing from the checkout is importable there."""

    path: Path
    user: User
    home: Path
    cache: Path  # TFSERVE_CACHE: empty, so the demo is never found exported
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def site_packages(self) -> Path:
        return next((self.path / "lib").glob("python3*/site-packages"))

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.path / 'bin'}:/usr/bin:/bin", "HOME": str(self.home),
                "TFSERVE_CACHE": str(self.cache), "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1"}

    def command(self, *args: str | Path) -> list[str]:
        return self.user.prefix + [str(self.python), *map(str, args)]

    def run(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*args), cwd=self.home, env=self.env(),
                              capture_output=True, text=True, timeout=TIMEOUT)

    def popen(self, *args: str | Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self.command(*args), cwd=self.home, env=self.env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.processes.append(proc)
        return proc


def make_venv(work: Path, name: str, user: User, requirements: Sequence[str | Path]) -> Venv:
    """A fresh venv (no system site-packages) with requirements installed, then read-only.
    requirements are pip install's arguments (`-c FILE` included)."""
    path = work / name
    run([user.python, "-m", "venv", path])
    home = work / f"{name}-home"  # onnxruntime keeps a telemetry id under $HOME/.cache
    cache = work / f"{name}-cache"
    for folder in (home, cache):
        folder.mkdir()
        if user.other and user.prefix:
            os.chown(folder, user.uid, user.gid)
    venv = Venv(path, user, home, cache)
    run([venv.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         *requirements], timeout=INSTALL_TIMEOUT)
    make_read_only(path)
    return venv


class LogReader:
    """Reads a process's JSON log lines from stderr on a thread; `wait_for` waits on them."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.closed = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def _find(self, event: str) -> dict[str, Any] | None:
        for line in self.lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                return record
        return None

    def wait_for(self, event: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        with self._changed:
            self._changed.wait_for(lambda: self._find(event) is not None or self.closed,
                                   timeout)
            record = self._find(event)
        assert record is not None, f"no {event!r} log record:\n" + "".join(self.lines[-30:])
        return record


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """A scratch directory the non-root user can read (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="tfserve-packaging-"))
    path.chmod(0o755)
    yield path
    if os.geteuid() != 0:  # root deletes read-only trees as they are
        make_writable(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def user() -> User:
    return find_user()


@pytest.fixture(scope="module")
def build_python(work: Path) -> Path:
    """The interpreter of a venv holding [build-system].requires: what pip's isolated build
    installs (the dev environment's grpcio-tools writes code for its own protobuf)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    path = work / "build-env"
    run([sys.executable, "-m", "venv", path])
    python = path / "bin" / "python"
    run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         *pyproject["build-system"]["requires"]], timeout=INSTALL_TIMEOUT)
    return python


@dataclass
class Built:
    sdist: Path
    wheel: Path
    metadata: str  # the wheel's METADATA


@pytest.fixture(scope="module")
def built(work: Path, build_python: Path) -> Built:
    """sdist from a fresh-clone copy; wheel from the sdist with its shipped stubs removed."""
    source = copy_source_tree(work / "src")
    assert not (source / STUB_DIR).exists(), "the copy must hold no generated stubs"
    sdist = build_backend("build_sdist", source, work / "dist", build_python)
    unpacked = work / "sdist"
    with tarfile.open(sdist) as archive:
        # the "data" filter (refuses links out of the tree) where this Python has it
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(unpacked, **safe)
    tree = next(unpacked.iterdir())
    # the wheel must make its own (a missing one is test_sdist_carries_...'s failure)
    shutil.rmtree(tree / "tfserve" / "proto" / "tfserve", ignore_errors=True)
    wheel = build_backend("build_wheel", tree, work / "dist", build_python)
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist()
                                     if n.endswith(".dist-info/METADATA"))).decode()
    return Built(sdist, wheel, metadata)


@pytest.fixture(scope="module")
def venv(work: Path, user: User, built: Built) -> Iterator[Venv]:
    """The wheel with its runtime dependencies, and proto-plus, in a fresh venv."""
    venv = make_venv(work, "venv", user, [built.wheel, "proto-plus"])
    yield venv
    for proc in venv.processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


@pytest.fixture(scope="module")
def served_model(work: Path) -> Path:
    """The exported demo (tests/exported.py), copied where the non-root user can read it."""
    from exported import demo_artifacts, demo_trained

    if not demo_trained():
        pytest.skip("the demo checkpoint is not trained: nothing translates 'seven'")
    out = work / "demo-model"
    shutil.copytree(demo_artifacts(), out)
    subprocess.run(["chmod", "-R", "a+rX", str(out)], check=True)
    return out


# -- the artifacts ------------------------------------------------------------------------------


def base_requirements(metadata: str) -> list[str]:
    """Requires-Dist lines that apply without extras."""
    lines = re.findall(r"^Requires-Dist: (.+)$", metadata, re.M)
    return [line for line in lines if "extra ==" not in line]


def test_wheel_ships_the_stubs_and_needs_no_build_tools(built: Built, work: Path) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        wheel.extractall(work / "wheel")
    assert {f"{STUB_DIR}/{name}" for name in STUBS} <= names
    assert {f"tfserve/proto/inference/{name}" for name in INFERENCE_STUBS} <= names
    assert "tfserve/proto/tfserve/SOURCE_SHA256" in names
    # the HTTP front end's page (GET /), with whatever else its directory holds
    static = ROOT / "tfserve" / "frontends" / "static"
    assert {f"tfserve/frontends/static/{path.name}" for path in static.glob("*")
            if path.is_file()} <= names
    # nothing at the top level but tfserve's own packages (no `proto/` of its own)
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"tfserve", "export"}
    requirements = base_requirements(metadata.decode())
    names_required = {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower() for r in requirements}
    assert "grpcio-tools" not in names_required and "torch" not in names_required
    # the stubs check grpcio and protobuf at import: the wheel must require at least those
    proto_build.check_floors(requirements, work / "wheel" / "tfserve" / "proto")
    needed = proto_build.needed_runtime(work / "wheel" / "tfserve" / "proto")
    assert set(needed) == {"grpcio", "protobuf"}


def test_wheel_declares_its_licence_as_spdx_and_ships_the_text(built: Built) -> None:
    # PEP 639: an SPDX expression and the licence file, not the deprecated TOML table
    assert "License-Expression: Apache-2.0" in built.metadata.splitlines()
    assert "License-File: LICENSE" in built.metadata.splitlines()
    with zipfile.ZipFile(built.wheel) as wheel:
        licences = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert licences, "the wheel carries no LICENSE"
        assert b"Apache License" in wheel.read(licences[0])


def test_sdist_carries_the_proto_sources_and_the_stubs(built: Built) -> None:
    with tarfile.open(built.sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert PROTO in names
    assert {f"{STUB_DIR}/{name}" for name in STUBS} <= names


def test_grpcio_tools_is_a_build_requirement_only() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())

    def pins(requirements: list[str]) -> list[str]:
        return [r for r in requirements if r.lower().startswith("grpcio-tools")]

    build_pin = pins(pyproject["build-system"]["requires"])
    assert len(build_pin) == 1 and "==" in build_pin[0], "one exact pin: reproducible stubs"
    assert not pins(pyproject["project"]["dependencies"])
    # the dev extra's grpcio-tools regenerates a checkout's stubs for the dev environment's
    # own protobuf: unpinned, since the build's pin needs protobuf < 6
    assert pins(pyproject["project"]["optional-dependencies"]["dev"]) == ["grpcio-tools"]
    assert pyproject["tool"]["setuptools"]["cmdclass"]["build_py"] == \
        "tfserve.proto.build.BuildPy"


# -- the installed wheel ------------------------------------------------------------------------


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    return lines[0]


def test_installed_wheel_imports_beside_proto_plus(venv: Venv) -> None:
    before = files_under(venv.path)
    assert venv.run("-c", "import torch").returncode != 0, "the venv must have no torch"
    done = venv.run("-c", "import proto, tfserve, tfserve.client, tfserve.server.main\n"
                          "from tfserve.proto import translator_pb2, translator_pb2_grpc\n"
                          "print(proto.__file__); print(tfserve.__file__)\n"
                          "print(translator_pb2_grpc.TranslatorStub.__name__)")
    assert done.returncode == 0, done.stderr
    proto_file, tfserve_file, stub = done.stdout.split()
    site = str(venv.site_packages())
    assert proto_file == f"{site}/proto/__init__.py", "proto-plus's `proto` package"
    assert tfserve_file == f"{site}/tfserve/__init__.py", "the wheel, not the checkout"
    assert stub == "TranslatorStub"
    check = venv.run("-m", "tfserve.proto.build", "--check")
    assert (check.returncode, check.stdout.strip()) == (0, "up to date"), check.stderr
    assert files_under(venv.path) == before, "importing tfserve wrote into the install"


def test_installed_wheel_cli_without_the_demo(venv: Venv) -> None:
    before = files_under(venv.path)
    done = venv.run("-m", "tfserve", "serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "--model" in done.stdout
    for args in (["translate", "seven"], ["serve", "--port", "0", "--metrics-port", "0"]):
        done = venv.run("-m", "tfserve", *args)
        line = one_line(done.stderr)
        assert done.returncode == 2, f"{args}: exit {done.returncode}: {done.stderr}"
        assert "tfserve[export]" in line and "--model" in line, line
        assert "Traceback" not in done.stderr
    assert files_under(venv.path) == before


def serve_and_translate(venv: Venv, model: Path) -> None:
    """`python -m tfserve serve` on model in venv; its client and its CLI translate over gRPC,
    then the server stops cleanly on SIGTERM."""
    proc = venv.popen("-m", "tfserve", "serve", "--model", model, "--host", "127.0.0.1",
                      "--port", "0", "--metrics-port", "0", "--http-port", "0", "--threads", "1",
                      "--log-format", "json", "--log-level", "info")
    log = LogReader(proc)
    target = f"127.0.0.1:{log.wait_for('serving')['port']}"
    client = venv.run("-c", "import sys\nfrom tfserve.client import Client\n"
                            "with Client(sys.argv[1], timeout=60) as client:\n"
                            "    print(client.translate(['seven', 'twelve'])[0])", target)
    assert (client.returncode, client.stdout.strip()) == (0, "sept"), client.stderr
    cli = venv.run("-m", "tfserve", "translate", "--server", target, "seven")
    assert (cli.returncode, cli.stdout.strip()) == (0, "sept"), cli.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 0, "".join(log.lines[-30:])


def test_installed_wheel_serves_the_demo(venv: Venv, served_model: Path) -> None:
    serve_and_translate(venv, served_model)


def installed_versions(venv: Venv, names: Sequence[str]) -> dict[str, str]:
    done = venv.run("-c", "import sys\nfrom importlib.metadata import version\n"
                          "for name in sys.argv[1:]: print(name, version(name))", *names)
    assert done.returncode == 0, done.stderr
    return dict(line.split() for line in done.stdout.splitlines())


def release(version: str) -> tuple[int, ...]:
    """'1.60.0' -> (1, 60): a release number without trailing zeros (1.60 == 1.60.0)."""
    parts = [int(part) for part in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def assert_stubs_import_quietly(venv: Venv) -> None:
    """The stubs import with every warning an error (protobuf 6.30 and 6.31 warn about 5.x
    gencode; a runtime that refuses it raises)."""
    done = venv.run("-W", "error", "-c", "from tfserve.proto import load; load()")
    assert done.returncode == 0, done.stderr


# -- the oldest runtimes the wheel allows -------------------------------------------------------

FLOORED = ("protobuf", "grpcio", "grpcio-health-checking", "grpcio-reflection")


def test_floors_are_what_the_stubs_need(built: Built, work: Path) -> None:
    """grpcio's and protobuf's floors are exactly the versions the generated code checks: no
    lower (the build would fail), no higher (tfserve would refuse environments it runs in)."""
    floors = proto_build.declared_floors(base_requirements(built.metadata))
    assert set(FLOORED) <= set(floors), floors
    out = work / "wheel-stubs"
    with zipfile.ZipFile(built.wheel) as wheel:
        wheel.extractall(out, [n for n in wheel.namelist() if n.startswith("tfserve/proto/")])
    needed = proto_build.needed_runtime(out / "tfserve" / "proto")
    assert {name: floors[name] for name in needed} == needed
    # protobuf 5.x: tfserve installs beside packages that hold protobuf below 6
    assert needed["protobuf"][0] == 5


@pytest.fixture(scope="module")
def floor_venv(work: Path, user: User, built: Built) -> Iterator[Venv]:
    """The wheel with protobuf, grpcio, grpcio-health-checking and grpcio-reflection at the
    floors its metadata declares (a constraints file holds them), the rest as pip resolves."""
    floors = proto_build.declared_floors(base_requirements(built.metadata))
    constraints = work / "floors.txt"
    constraints.write_text("".join(
        f"{name}=={'.'.join(map(str, floors[name]))}\n" for name in FLOORED))
    constraints.chmod(0o644)
    venv = make_venv(work, "floor-venv", user, ["-c", constraints, built.wheel])
    yield venv
    for proc in venv.processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


def test_wheel_serves_on_the_floor_versions(floor_venv: Venv, built: Built,
                                            served_model: Path) -> None:
    floors = proto_build.declared_floors(base_requirements(built.metadata))
    installed = installed_versions(floor_venv, FLOORED)
    assert {name: release(v) for name, v in installed.items()} == \
        {name: release(".".join(map(str, floors[name]))) for name in FLOORED}
    assert_stubs_import_quietly(floor_venv)
    serve_and_translate(floor_venv, served_model)


# -- beside the ecosystem -----------------------------------------------------------------------

ECOSYSTEM = ("tritonclient[http,grpc]", "kserve")


@pytest.mark.slow
def test_wheel_installs_beside_tritonclient_and_kserve(work: Path, user: User, built: Built,
                                                       served_model: Path) -> None:
    """One environment with tfserve, tritonclient's HTTP and gRPC clients and kserve (both
    hold protobuf below 7): pip resolves it, `pip check` is clean, each imports beside
    tfserve and tfserve serves and answers its own client."""
    venv = make_venv(work, "ecosystem-venv", user, [built.wheel, *ECOSYSTEM])
    try:
        check = venv.run("-m", "pip", "check")
        assert check.returncode == 0, check.stdout + check.stderr
        # each beside tfserve, one process each: kserve and tritonclient.grpc both register
        # the open inference protocol's `inference.*` messages in protobuf's default pool, so
        # one process cannot import both (with or without tfserve)
        for other in ("kserve", "tritonclient.grpc, tritonclient.http"):
            done = venv.run("-c", f"import tfserve.client, tfserve.server.main, {other}")
            assert done.returncode == 0, done.stderr
        assert installed_versions(venv, ["protobuf"])["protobuf"].split(".")[0] != "7"
        assert_stubs_import_quietly(venv)
        serve_and_translate(venv, served_model)
    finally:
        for proc in venv.processes:
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)


# -- what docs/deployment.md says about installing ---------------------------------------------

DEPLOYMENT = ROOT / "docs" / "deployment.md"
GPU_SECTION = "### GPU without the image: pip"
# run in the GPU venv: who owns the `onnxruntime` module, what it is, and the files of
# onnxruntime-gpu's RECORD that are missing or not as its wheel wrote them
ONNXRUNTIME_STATE = """
import base64, hashlib, importlib.metadata as metadata, json
import onnxruntime
owners = sorted(metadata.packages_distributions().get("onnxruntime", []))
changed = []
if "onnxruntime-gpu" in owners:
    for file in metadata.distribution("onnxruntime-gpu").files or []:
        if file.hash is None:
            continue
        try:
            digest = hashlib.new(file.hash.mode, file.locate().read_bytes()).digest()
        except FileNotFoundError:
            changed.append(str(file))
            continue
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != file.hash.value:
            changed.append(str(file))
print(json.dumps({"owners": owners, "version": getattr(onnxruntime, "__version__", None),
                  "providers": onnxruntime.get_available_providers(), "changed": changed,
                  "gpu": metadata.version("onnxruntime-gpu") if "onnxruntime-gpu" in owners
                  else None}))
"""


def test_deployment_doc_lists_the_base_dependencies() -> None:
    """The image's venv holds pyproject.toml's base dependencies: docs/deployment.md names
    each of them, and nothing else, where it says so."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()
             for requirement in project["dependencies"]}
    listed = re.search(r"the base dependencies of\s+pyproject\.toml \(([^)]*)\)",
                       DEPLOYMENT.read_text(encoding="utf-8"))
    assert listed, "docs/deployment.md no longer lists the base dependencies"
    assert {name.strip() for name in listed.group(1).split(",")} == names


def documented_gpu_recipe() -> list[list[str]]:
    """The commands of docs/deployment.md's pip GPU recipe, as written."""
    section = DEPLOYMENT.read_text(encoding="utf-8").split(GPU_SECTION, 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, f"no sh block under {GPU_SECTION!r}"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.slow
def test_documented_gpu_install_leaves_one_onnxruntime(work: Path, built: Built) -> None:
    """docs/deployment.md's pip recipe for CUDA, run as written on the built wheel
    (onnxruntime-gpu comes from the index: about 250 MB). `tfserve[gpu]` alone leaves two
    distributions owning the `onnxruntime` module (why the recipe exists); after the recipe
    onnxruntime-gpu owns it alone, every file as its wheel wrote it, its build lists the CUDA
    provider (the providers a build has, with or without a GPU) and tfserve's runtime imports
    on it."""
    recipe = documented_gpu_recipe()
    assert [command[:2] for command in recipe] == [["pip", "install"], ["pip", "uninstall"],
                                                   ["pip", "install"]], recipe
    path = work / "gpu-venv"
    run([sys.executable, "-m", "venv", path])
    python = path / "bin" / "python"

    def state() -> dict[str, Any]:
        return json.loads(run([python, "-c", ONNXRUNTIME_STATE], cwd=work).stdout)

    for number, (_, verb, *args) in enumerate(recipe):
        args = [f"{built.wheel}[gpu]" if arg == "tfserve[gpu]" else arg for arg in args]
        run([python, "-m", "pip", verb, "--quiet", "--disable-pip-version-check", *args],
            timeout=INSTALL_TIMEOUT)
        if number == 0:
            assert state()["owners"] == ["onnxruntime", "onnxruntime-gpu"]
    after = state()
    assert after["owners"] == ["onnxruntime-gpu"], after
    assert after["changed"] == [] and after["version"] == after["gpu"], after
    assert "CUDAExecutionProvider" in after["providers"], after
    run([python, "-c", "import tfserve.runtime, tfserve.server.main"], cwd=work)


def test_runs_as_another_user(work: Path, user: User) -> None:
    """The read-only checks above mean something only for a user whom read-only stops: the
    processes the venvs run (user.prefix) are not root's, and cannot write in a directory
    made read-only as make_venv makes the venvs."""
    if not user.other:
        pytest.skip(user.reason)
    locked = work / "read-only-probe"
    locked.mkdir()
    make_read_only(locked)
    probe = subprocess.run(
        user.prefix + [user.python, "-c", "import os, sys\nprint(os.geteuid(), flush=True)\n"
                       "open(os.path.join(sys.argv[1], 'written'), 'w')", str(locked)],
        capture_output=True, text=True, timeout=60, cwd="/")
    assert int(probe.stdout.split()[0]) != 0, probe.stdout
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr
    assert not (locked / "written").exists()


# -- an editable install of a read-only checkout ------------------------------------------------


def test_editable_install_generates_the_stubs_at_install_time(work: Path, user: User,
                                                              build_python: Path) -> None:
    """pip install -e: the build (not the first import) writes the stubs into the checkout;
    the checkout can then be read-only and another user's."""
    source = copy_source_tree(work / "editable-src")
    assert not (source / STUB_DIR).exists()
    editable = build_backend("build_editable", source, work / "editable-dist", build_python)
    assert all((source / STUB_DIR / name).is_file() for name in STUBS)
    subprocess.run(["chmod", "-R", "a+rX", str(source)], check=True)
    make_read_only(source)
    before = files_under(source)
    venv = make_venv(work, "editable-venv", user, [editable, "proto-plus"])
    done = venv.run("-c", "import proto, tfserve, tfserve.client, tfserve.server.main\n"
                          "from tfserve.proto import translator_pb2_grpc\n"
                          "print(tfserve.__file__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(source / "tfserve" / "__init__.py")
    check = venv.run("-m", "tfserve.proto.build", "--check")  # against the checkout's proto/
    assert (check.returncode, check.stdout.strip()) == (0, "up to date"), check.stderr
    assert venv.run("-m", "tfserve", "serve", "--help").returncode == 0
    assert files_under(source) == before, "importing tfserve wrote into the checkout"


# -- without a build --------------------------------------------------------------------------


def test_missing_stubs_are_an_error_not_a_generation(work: Path) -> None:
    """A source tree nobody built: importing the stubs names the fix and writes nothing."""
    source = copy_source_tree(work / "unbuilt-src")
    make_read_only(source)
    before = files_under(source)
    done = subprocess.run(
        [sys.executable, "-c", "from tfserve.proto import translator_pb2"], cwd=source,
        env={**os.environ, "PYTHONPATH": str(source), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tfserve.proto.StubsMissingError:"), done.stderr
    assert "python -m tfserve.proto.build" in last and "reinstall" in last
    assert files_under(source) == before


def test_checkout_detection_ignores_other_proto_packages(tmp_path: Path) -> None:
    """site-packages/proto (proto-plus) is not tfserve's proto/; a checkout's is."""
    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / "__init__.py").write_text("")
    assert proto_build.checkout_proto_root(tmp_path) is None
    assert proto_build.checkout_proto_root(ROOT) == ROOT / "proto"


def test_a_build_refuses_floors_below_what_its_stubs_check() -> None:
    needed = proto_build.needed_runtime()  # the checkout's stubs
    grpcio = ".".join(map(str, needed["grpcio"]))
    protobuf = ".".join(map(str, needed["protobuf"]))
    proto_build.check_floors([f"grpcio>={grpcio}", f"protobuf >= {protobuf}; python_version>'3'"])
    with pytest.raises(RuntimeError, match="need grpcio>="):
        proto_build.check_floors(["grpcio>=1.60", f"protobuf>={protobuf}"])
    with pytest.raises(RuntimeError, match="need protobuf>="):
        proto_build.check_floors([f"grpcio>={grpcio}", "protobuf"])


def test_needed_protobuf_from_the_gencode_header_without_a_runtime_check(
        tmp_path: Path) -> None:
    """Code from protoc releases without ValidateProtobufRuntimeVersion (grpcio-tools 1.63 to
    1.65) names its gencode version only in its header: that version is the floor."""
    stubs = tmp_path / "tfserve" / "v1"
    stubs.mkdir(parents=True)
    (stubs / "x_pb2.py").write_text("# -*- coding: utf-8 -*-\n"
                                    "# Protobuf Python Version: 5.26.1\n"
                                    "from google.protobuf import descriptor as _descriptor\n")
    (stubs / "x_pb2_grpc.py").write_text("GRPC_GENERATED_VERSION = '1.63.2'\n")
    assert proto_build.needed_runtime(tmp_path) == {"grpcio": (1, 63, 2),
                                                    "protobuf": (5, 26, 1)}
    with pytest.raises(RuntimeError, match="need protobuf>=5.26.1"):
        proto_build.check_floors(["grpcio>=1.63.2", "protobuf>=5.26"], tmp_path)
