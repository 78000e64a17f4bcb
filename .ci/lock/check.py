"""Checks that what a lock installed is complete and consistent: every requirement of tfserve
with the lock's extras, followed through the installed distributions' own requirements, is
installed at a version that satisfies it. `pip install --no-deps -r LOCK` resolves nothing, so
this is what shows that the lock left nothing out.

    python .ci/lock/check.py .ci/lock/dev.txt
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# the extras each lock holds: its first line, written by .ci/lock/update, says which
EXTRAS = re.compile(r"^# extras: *(.*)$")


def lock_extras(lock: Path) -> list[str]:
    found = EXTRAS.match(lock.read_text().splitlines()[0])
    if found is None:
        raise SystemExit(f"{lock}: the first line does not name the extras (# extras: ...)")
    return found.group(1).split()


def missing(root: str, extras: list[str]) -> list[str]:
    """Requirements under root (with extras) that the environment does not satisfy."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        for extra in sorted(wanted) or [""]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in metadata.requires(name) or []:
                requirement = Requirement(line)
                env = {"extra": extra}
                if requirement.marker and not requirement.marker.evaluate(env):
                    continue
                try:
                    version = metadata.version(requirement.name)
                except metadata.PackageNotFoundError:
                    problems.append(f"{name} needs {requirement}: not installed")
                    continue
                if not requirement.specifier.contains(version, prereleases=True):
                    problems.append(f"{name} needs {requirement}: {version} is installed")
                    continue
                todo.append((canonicalize_name(requirement.name),
                             frozenset(requirement.extras)))
    return problems


def main() -> int:
    lock = Path(sys.argv[1])
    problems = missing("tfserve", lock_extras(lock))
    for problem in problems:
        print(f"{lock}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
