"""The locked test environment (.ci/lock/): every package pinned with its hashes, the README's
lock a subset of CI's at the same versions, pyproject's requirements met by the pins, and the
holds kept. Reads files only: installing from the lock is .ci/install's job (CI runs it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: pip vendors a TOML parser
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / ".ci" / "lock"
# one requirement of a lock: `name[extras]==version \` then its `--hash=sha256:...` lines
ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+) \\\n"
                   r"((?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", re.M)
NAME = re.compile(r"[=\[ ]")


def read_lock(name: str) -> tuple[list[str], dict[str, str]]:
    """(the extras the lock holds, {canonical name: version})."""
    text = (LOCKS / name).read_text()
    extras = re.match(r"# extras: *(.*)\n", text)
    assert extras, f"{name}: the first line must name the lock's extras"
    pins = {canonicalize_name(m.group(1)): m.group(2) for m in ENTRY.finditer(text)}
    return extras.group(1).split(), pins


def requirement_lines(text: str) -> list[str]:
    """The lock's requirement lines (not comments, hashes or continuations)."""
    return [line for line in text.splitlines()
            if line and not line.startswith(("#", " "))]


@pytest.mark.parametrize("name", ["dev.txt", "full.txt"])
def test_every_package_is_pinned_with_hashes(name: str) -> None:
    text = (LOCKS / name).read_text()
    lines = requirement_lines(text)
    _, pins = read_lock(name)
    unpinned = [line for line in lines if canonicalize_name(NAME.split(line)[0]) not in pins]
    assert lines and not unpinned, f"{name}: entries without == or hashes: {unpinned}"
    assert "torch" not in pins, "torch is installed on its own (the CPU build), not from the lock"


def test_the_readme_lock_is_ci_lock_at_the_same_versions() -> None:
    dev_extras, dev = read_lock("dev.txt")
    full_extras, full = read_lock("full.txt")
    assert set(dev_extras) <= set(full_extras)
    moved = {name: (version, full.get(name)) for name, version in dev.items()
             if full.get(name) != version}
    assert not moved, f"dev.txt pins that full.txt pins differently (dev, full): {moved}"


@pytest.mark.parametrize("name", ["dev.txt", "full.txt"])
def test_pyproject_requirements_are_met_by_the_pins(name: str) -> None:
    extras, pins = read_lock(name)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    unmet = []
    for line in wanted:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        key = canonicalize_name(requirement.name)
        if key == "torch":  # .ci/install's own step: torch==2.13.0
            assert requirement.specifier.contains("2.13.0"), requirement
            continue
        if key not in pins or not requirement.specifier.contains(pins[key], prereleases=True):
            unmet.append(f"{line} (locked: {pins.get(key)})")
    assert not unmet, f"{name} does not satisfy pyproject.toml: {unmet}"


def test_the_holds_are_kept() -> None:
    holds = [Requirement(line) for line in (LOCKS / "holds.txt").read_text().splitlines()
             if line and not line.startswith(("#", "extra:"))]
    assert holds
    for name in ("dev.txt", "full.txt"):
        _, pins = read_lock(name)
        for hold in holds:
            version = pins.get(canonicalize_name(hold.name))
            assert version is None or hold.specifier.contains(version), (name, str(hold), version)
