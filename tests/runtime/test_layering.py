"""Imports run one way: the runtime implements the step contract (tfserve.step) and imports
nothing of the searches above it; the contract imports neither side. Read from the files'
syntax trees (no import is executed), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import tfserve

PACKAGE = Path(tfserve.__file__).parent


def _imported(path: Path) -> set[str]:
    """Every module `path` imports, absolute (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for name in sorted(_imported(path)):
            if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return found


def test_the_runtime_imports_nothing_of_generation() -> None:
    assert _offending("runtime", ("tfserve.generation",)) == []


def test_the_step_contract_imports_neither_side() -> None:
    assert _offending("step", ("tfserve.generation", "tfserve.runtime", "tfserve.model")) == []


def test_the_searches_name_no_placement_graph_or_session() -> None:
    """generation/ reaches the runtime only through the contract: it imports no runtime
    module, no onnxruntime and no onnx."""
    assert _offending("generation", ("tfserve.runtime", "onnxruntime", "onnx")) == []

