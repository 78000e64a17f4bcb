"""Generate the Python gRPC stubs from proto/, at build time and as a developer tool.

    proto/tfserve/v1/translator.proto  ->  tfserve/proto/tfserve/v1/translator_pb2.py
                                           tfserve/proto/tfserve/v1/translator_pb2.pyi
                                           tfserve/proto/tfserve/v1/translator_pb2_grpc.py
    proto/inference/grpc_service.proto ->  tfserve/proto/inference/grpc_service_pb2.py (.pyi,
                                           _pb2_grpc.py): the Open Inference Protocol

Building tfserve generates them: pyproject.toml's [tool.setuptools.cmdclass] names `BuildPy`
and `Sdist` below, so a wheel and an sdist carry the stubs (and the sdist carries proto/ too),
and an editable install writes them into the source tree. grpcio-tools is a build requirement
only; nothing runs protoc when tfserve is imported, and an installed tfserve never writes to
its own directory. The generated files are not committed (tfserve/proto/.gitignore).

Builds use the grpcio-tools pinned in [build-system].requires, an old release on purpose:
the code it writes imports on protobuf 5.x, 6.x and 7.x and on grpcio from that release on
(pyproject.toml says why that release). The build hooks check that the stubs they wrote need
no more than the package's grpcio/protobuf floors (`check_floors`).

In a source checkout, `python -m tfserve.proto.build` regenerates them after a .proto change
and `python -m tfserve.proto.build --check` says whether they match the .proto sources.

protoc names the package of a generated module after the .proto path (`tfserve.v1`), which
would collide with this `tfserve` package; the stubs therefore live one level down, under
`tfserve.proto.tfserve.v1`, and the one import protoc writes into `*_pb2_grpc.py` is
rewritten to that path (`inference` likewise becomes `tfserve.proto.inference`).

The `inference` package's messages are the Open Inference Protocol's, which tritonclient and
kserve also register in protobuf's default descriptor pool (a second registration of a name
fails the import): its generated `*_pb2.py` modules are rewritten to register them in a pool
of their own (tfserve/proto/private_pool.py), so that tfserve imports beside either client.

This module is also loaded by setuptools on its own, as a file (not through the `tfserve`
package): it imports nothing from tfserve.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # tfserve/
OUT_DIR = Path(__file__).resolve().parent  # generated modules go under tfserve/proto/<package>/
STAMP = "SOURCE_SHA256"  # digest of the .proto sources the stubs were generated from
# the generated packages (proto/'s top-level folders) and the modules each must hold
STUB_FILES = {
    "tfserve/v1": ("translator_pb2.py", "translator_pb2.pyi", "translator_pb2_grpc.py"),
    "inference": ("grpc_service_pb2.py", "grpc_service_pb2.pyi", "grpc_service_pb2_grpc.py"),
}
GENERATED = ("tfserve", "inference")
# packages whose messages go to tfserve's own descriptor pool, not protobuf's default one
PRIVATE_POOL_PACKAGES = ("inference",)
PRIVATE_POOL = "tfserve.proto.private_pool"


def checkout_proto_root(project_dir: Path = PACKAGE_DIR.parent) -> Path | None:
    """The repository's proto/ (protoc's include root) when project_dir is a tfserve source
    tree, else None.

    An installed tfserve's parent directory is site-packages, where a `proto` directory
    belongs to someone else (proto-plus installs a top-level `proto` package): only a proto/
    holding tfserve's own .proto tree next to a pyproject.toml counts.
    """
    root = project_dir / "proto"
    if (project_dir / "pyproject.toml").is_file() and (root / "tfserve").is_dir():
        return root
    return None


def _root_or_error(root: Path | None) -> Path:
    root = root if root is not None else checkout_proto_root()
    if root is None:
        raise RuntimeError("no proto/ sources here: the stubs are generated from a tfserve "
                           "source checkout (an installed tfserve ships them already)")
    return root


def proto_files(root: Path) -> list[Path]:
    """Every .proto under root, sorted (relative paths are what protoc is given)."""
    return sorted(root.rglob("*.proto"))


def source_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in proto_files(root):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def stamp_path(out_dir: Path = OUT_DIR) -> Path:
    return out_dir / "tfserve" / STAMP


def stubs_present(out_dir: Path = OUT_DIR) -> bool:
    """True when every generated module is there (what an installed tfserve ships)."""
    return all((out_dir / folder / name).is_file()
               for folder, names in STUB_FILES.items() for name in names)


def is_stale(root: Path | None = None, out_dir: Path = OUT_DIR) -> bool:
    """True when the stubs are missing or were generated from other .proto sources.

    root defaults to the checkout's proto/; without one (an installed tfserve) only the
    presence of the shipped stubs is checked.
    """
    root = root if root is not None else checkout_proto_root()
    if not stubs_present(out_dir):
        return True
    if root is None:
        return False
    stamp = stamp_path(out_dir)
    return not stamp.is_file() or stamp.read_text().strip() != source_digest(root)


def build(root: Path | None = None, out_dir: Path = OUT_DIR) -> list[Path]:
    """Run protoc (grpc_tools) over root into out_dir; returns the files written.

    root defaults to the checkout's proto/. Generates into a temporary directory and moves
    each file into place with os.replace, so a process importing the stubs meanwhile never
    sees a half-written module.
    """
    root = _root_or_error(root)
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError("generating the gRPC stubs needs grpcio-tools (the 'dev' extra; "
                           "a build gets it from [build-system].requires)") from exc
    sources = proto_files(root)
    if not sources:
        raise RuntimeError(f"no .proto files under {root}")
    well_known = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [path.relative_to(root).as_posix() for path in sources]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {root}")
        generated = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        # every generated folder becomes a regular package (setuptools finds it, mypy too)
        for folder in {p.parent for p in generated}:
            while folder != Path(tmp):
                init = folder / "__init__.py"
                if not init.exists():
                    init.write_text("")
                folder = folder.parent
        for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            relative = path.relative_to(tmp)
            if path.name.endswith("_pb2_grpc.py"):
                path.write_text(_fix_imports(path.read_text(), sources, root))
            elif path.name.endswith("_pb2.py") and relative.parts[0] in PRIVATE_POOL_PACKAGES:
                path.write_text(_private_pool(path.read_text(), path.name))
            target = out_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
            written.append(target)
        stamp = stamp_path(out_dir)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tmp) / STAMP
        staged.write_text(source_digest(root) + "\n")
        os.replace(staged, stamp)
        written.append(stamp)
    return written


def _fix_imports(text: str, sources: list[Path], root: Path) -> str:
    """`from tfserve.v1 import x_pb2` -> `from tfserve.proto.tfserve.v1 import x_pb2`."""
    for path in sources:
        module = ".".join(path.relative_to(root).with_suffix("").parts[:-1])  # tfserve.v1
        text = text.replace(f"from {module} import ", f"from tfserve.proto.{module} import ")
    return text


_POOL_IMPORT = "from google.protobuf import descriptor_pool as _descriptor_pool\n"
_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("


def _private_pool(text: str, name: str) -> str:
    """A generated `*_pb2.py` that registers its file in PRIVATE_POOL's pool instead of
    protobuf's default one."""
    if text.count(_DEFAULT_POOL) != 1 or text.count(_POOL_IMPORT) != 1:
        raise RuntimeError(f"{name}: protoc's output does not register its file once in the "
                           "default descriptor pool; the private-pool rewrite needs updating")
    module, _, attribute = PRIVATE_POOL.rpartition(".")
    text = text.replace(_POOL_IMPORT,
                        f"{_POOL_IMPORT}from {module} import {attribute} as _private_pool\n")
    return text.replace(_DEFAULT_POOL, "_private_pool.POOL.AddSerializedFile(")


def clean(out_dir: Path = OUT_DIR) -> None:
    """Remove the generated trees (tfserve/proto/tfserve/, tfserve/proto/inference/)."""
    for package in GENERATED:
        shutil.rmtree(out_dir / package, ignore_errors=True)


# -- runtime versions the stubs need ----------------------------------------------------------
# Generated modules check the installed runtime when imported: `*_pb2_grpc.py` refuses a
# grpcio older than the grpcio-tools that wrote it, `*_pb2.py` a protobuf older than protoc's
# gencode version (protobuf's runtime_version.ValidateProtobufRuntimeVersion). A wheel must
# therefore require at least those versions; `check_floors` makes a build fail when
# pyproject.toml's dependencies promise less. Code from protoc releases without that call
# (grpcio-tools 1.63 to 1.65) still names its gencode version in its header, which is used
# instead: it was written against that runtime.

_GRPC_GENERATED = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", re.M)
_PROTOBUF_GENERATED = re.compile(
    r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
    r"(\d+),\s*(\d+),\s*(\d+),")
_PROTOBUF_HEADER = re.compile(r"^# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", re.M)
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed_runtime(out_dir: Path = OUT_DIR) -> dict[str, tuple[int, ...]]:
    """{'grpcio': (1, 85, 1), 'protobuf': (7, 35, 1)}: the oldest runtimes the generated
    modules under out_dir accept (an entry is absent when its module has no such check)."""
    needed: dict[str, tuple[int, ...]] = {}
    generated = [path for package in GENERATED for path in (out_dir / package).rglob("*.py")]
    for path in (p for p in generated if p.name.endswith("_pb2_grpc.py")):
        match = _GRPC_GENERATED.search(path.read_text())
        if match:
            needed["grpcio"] = max(needed.get("grpcio", ()), _version(match.group(1)))
    for path in (p for p in generated if p.name.endswith("_pb2.py")):
        text = path.read_text()
        found = _PROTOBUF_GENERATED.search(text) or _PROTOBUF_HEADER.search(text)
        if found:
            version = tuple(int(group) for group in found.groups())
            needed["protobuf"] = max(needed.get("protobuf", ()), version)
    return needed


def declared_floors(requirements: list[str]) -> dict[str, tuple[int, ...]]:
    """{'grpcio': (1, 85, 1), ...}: the `>=` floor of each requirement that has one."""
    floors: dict[str, tuple[int, ...]] = {}
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if not match:
            continue
        floor = re.search(r">=\s*([0-9][0-9.]*)", match.group(2))
        if floor:
            floors[_canonical(match.group(1))] = _version(floor.group(1))
    return floors


def check_floors(requirements: list[str], out_dir: Path = OUT_DIR) -> None:
    """Raise RuntimeError when requirements allow a grpcio or protobuf older than the
    generated stubs under out_dir accept."""
    floors = declared_floors(requirements)
    for name, needed in sorted(needed_runtime(out_dir).items()):
        floor = floors.get(name)
        if floor is None or floor < needed:
            shown = ".".join(map(str, needed))
            raise RuntimeError(
                f"the generated gRPC stubs need {name}>={shown} at run time, but the "
                f"package requires {name}>={'.'.join(map(str, floor or ())) or '(any)'}: "
                f"build with the grpcio-tools pinned in pyproject.toml's "
                f"[build-system].requires (pip's default isolated build installs it; this "
                f"build's stubs came from grpcio-tools {_tools_version()}), or raise that "
                f"floor in [project].dependencies")


def _tools_version() -> str:
    """The installed grpcio-tools release, for messages ('unknown' without one)."""
    from importlib import metadata

    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return "unknown"


# -- setuptools build hooks ---------------------------------------------------------------------
# Named by pyproject.toml's [tool.setuptools.cmdclass]. setuptools is only there at build time:
# an installed tfserve (which never needs these classes) may not have it.

try:
    from setuptools.command.build_py import build_py as _build_py
    from setuptools.command.sdist import sdist as _sdist
except ImportError:
    _build_py = _sdist = None  # type: ignore[assignment,misc]

if _build_py is not None and _sdist is not None:

    class BuildPy(_build_py):
        """build_py, then the stubs: into build_lib for a wheel (which ships them), into the
        source tree for an editable install (whose modules are imported from there)."""

        def run(self) -> None:
            super().run()
            package_dir = Path(self.get_package_dir("tfserve")).resolve()
            root = _root_or_error(checkout_proto_root(package_dir.parent))
            if self.editable_mode:
                build(root, package_dir / "proto")
                return
            out_dir = Path(self.build_lib) / "tfserve" / "proto"
            clean(out_dir)  # stale copies of an older generation from the source tree
            build(root, out_dir)
            check_floors(list(self.distribution.install_requires or []), out_dir)

    class Sdist(_sdist):
        """sdist whose release tree also holds the generated stubs (proto/ itself comes in
        through MANIFEST.in, so that a wheel built from the sdist generates them again)."""

        def make_release_tree(self, base_dir: str, files: list[str]) -> None:
            super().make_release_tree(base_dir, files)
            root = _root_or_error(checkout_proto_root(Path.cwd()))
            out_dir = Path(base_dir) / "tfserve" / "proto"
            # the release tree hard-links the source files: replace (never rewrite) them
            clean(out_dir)
            build(root, out_dir)
            check_floors(list(self.distribution.install_requires or []), out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfserve.proto.build",
        description="Generate the gRPC stubs from proto/ in a tfserve source checkout.")
    parser.add_argument("--check", action="store_true",
                        help="only report whether the stubs are up to date (exit 1 if stale); "
                             "in an installed tfserve, whether they were shipped")
    parser.add_argument("--clean", action="store_true", help="remove the generated stubs first")
    args = parser.parse_args(argv)
    if args.check:
        stale = is_stale()
        print("stale" if stale else "up to date")
        return 1 if stale else 0
    try:
        root = _root_or_error(None)
        if args.clean:
            clean()
        written = build(root)
    except RuntimeError as exc:
        print(f"python -m tfserve.proto.build: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path.relative_to(PACKAGE_DIR.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
