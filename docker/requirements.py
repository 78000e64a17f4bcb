"""Print pyproject.toml's dependencies, one per line, for `pip install -r` in the images.

    python requirements.py pyproject.toml                      # the serving path (base deps)
    python requirements.py pyproject.toml --extra export       # + the export extra (torch, onnx)
    python requirements.py pyproject.toml --gpu                # onnxruntime -> the gpu extra
    python requirements.py pyproject.toml --gpu --pin 'onnxruntime-gpu==1.31.1'

The images install dependencies from this list before the package itself, so that a source
change does not reinstall them (the layer only depends on pyproject.toml). `--gpu` swaps the
CPU `onnxruntime` for the `gpu` extra's `onnxruntime-gpu`: the two wheels install the same
`onnxruntime` module and must never be installed together. `--pin` replaces the requirement of
the same project name.
"""

from __future__ import annotations

import argparse
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors a TOML parser
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]


def project_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"cannot read a project name from {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: dict, extras: list[str], gpu: bool, pins: list[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    for extra in extras + (["gpu"] if gpu else []):
        if extra not in optional:
            raise ValueError(f"pyproject.toml has no extra {extra!r}")
    lines = list(project.get("dependencies", []))
    if gpu:
        lines = [line for line in lines if project_name(line) != "onnxruntime"]
        lines += optional["gpu"]
    for extra in extras:
        lines += optional[extra]
    for pin in pins:
        name = project_name(pin)
        lines = [line for line in lines if project_name(line) != name] + [pin]
    seen: set[str] = set()
    out = []
    for line in lines:
        if line not in seen:
            seen.add(line)
            out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pyproject")
    parser.add_argument("--extra", action="append", default=[], help="add an extra's deps")
    parser.add_argument("--gpu", action="store_true", help="onnxruntime -> onnxruntime-gpu")
    parser.add_argument("--pin", action="append", default=[],
                        help="replace the requirement of this project with the one given")
    args = parser.parse_args(argv)
    with open(args.pyproject, "rb") as handle:
        pyproject = tomllib.load(handle)
    try:
        lines = requirements(pyproject, args.extra, args.gpu, [p for p in args.pin if p])
    except ValueError as exc:
        print(f"requirements.py: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
