"""Generate the Python gRPC stubs from proto/: `python -m tfserve.proto_build [--check]`.

    proto/tfserve/v1/translator.proto  ->  tfserve/proto/tfserve/v1/translator_pb2.py
                                           tfserve/proto/tfserve/v1/translator_pb2.pyi
                                           tfserve/proto/tfserve/v1/translator_pb2_grpc.py

The generated files are not committed (tfserve/proto/.gitignore); `tfserve.proto` runs this
step on first import when they are missing or older than the .proto sources, so a fresh
clone works as soon as grpcio-tools is installed. A serving image runs it once at build time
and needs no grpcio-tools afterwards.

protoc names the package of a generated module after the .proto path (`tfserve.v1`), which
would collide with this `tfserve` package; the stubs therefore live one level down, under
`tfserve.proto.tfserve.v1`, and the one import protoc writes into `*_pb2_grpc.py` is
rewritten to that path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parent / "proto"  # the repository's proto/ (include root for protoc)
OUT_DIR = PACKAGE_DIR / "proto"  # generated modules go under tfserve/proto/tfserve/v1/
STAMP = "SOURCE_SHA256"  # digest of the .proto sources the stubs were generated from


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under root, sorted (relative paths are what protoc is given)."""
    return sorted(root.rglob("*.proto"))


def source_digest(root: Path = PROTO_ROOT) -> str:
    digest = hashlib.sha256()
    for path in proto_files(root):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def stamp_path(out_dir: Path = OUT_DIR) -> Path:
    return out_dir / "tfserve" / STAMP


def is_stale(root: Path = PROTO_ROOT, out_dir: Path = OUT_DIR) -> bool:
    """True when the stubs are missing or were generated from other .proto sources.

    Without proto/ (an installed wheel) the stubs shipped with the package are used as they are.
    """
    stamp = stamp_path(out_dir)
    if not root.is_dir():
        return not (out_dir / "tfserve" / "v1" / "translator_pb2_grpc.py").is_file()
    if not stamp.is_file():
        return True
    return stamp.read_text().strip() != source_digest(root)


def build(root: Path = PROTO_ROOT, out_dir: Path = OUT_DIR) -> list[Path]:
    """Run protoc (grpc_tools) over root into out_dir; returns the files written.

    Generates into a temporary directory and moves each file into place with os.replace, so
    two processes building at once (a test and the server it started) never see a half
    written module.
    """
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # the serving image generates at build time instead
        raise RuntimeError("generating the gRPC stubs needs grpcio-tools "
                           "(pip install grpcio-tools, or the 'dev' extra)") from exc
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
            target = out_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
            written.append(target)
        stamp = stamp_path(out_dir)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tmp) / STAMP
        staged.write_text(source_digest(root) + "\n")
        os.replace(staged, stamp)
    return written


def _fix_imports(text: str, sources: list[Path], root: Path) -> str:
    """`from tfserve.v1 import x_pb2` -> `from tfserve.proto.tfserve.v1 import x_pb2`."""
    for path in sources:
        module = ".".join(path.relative_to(root).with_suffix("").parts[:-1])  # tfserve.v1
        text = text.replace(f"from {module} import ", f"from tfserve.proto.{module} import ")
    return text


def clean(out_dir: Path = OUT_DIR) -> None:
    """Remove the generated tree (tfserve/proto/tfserve/)."""
    shutil.rmtree(out_dir / "tfserve", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfserve.proto_build",
                                     description="Generate the gRPC stubs from proto/.")
    parser.add_argument("--check", action="store_true",
                        help="only report whether the stubs are up to date (exit 1 if stale)")
    parser.add_argument("--clean", action="store_true", help="remove the generated stubs first")
    args = parser.parse_args(argv)
    if args.check:
        stale = is_stale()
        print("stale" if stale else "up to date")
        return 1 if stale else 0
    if args.clean:
        clean()
    try:
        written = build()
    except RuntimeError as exc:
        print(f"python -m tfserve.proto_build: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path.relative_to(PACKAGE_DIR.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
