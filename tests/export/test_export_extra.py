"""`python -m export` where the `export` extra is not installed (the base wheel): one line on
stderr naming what to install, exit code 2, as README promises; never a traceback.

Each run is a fresh interpreter whose import system refuses the named modules (a finder first
in sys.meta_path raising ModuleNotFoundError for them, as an absent package does), so torch,
onnx, ... are missing there while this environment keeps them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: pip vendors a TOML parser
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

from export.cli import EXPORT_EXTRA_MODULES, TORCH_REQUIREMENT

ROOT = Path(__file__).resolve().parents[2]

# runs `python -m export ARGS` with the modules in BLOCKED unimportable; PATCH_CHECK=1 turns
# the check before the work off, so that the import inside the export meets the absence
BLOCKING_RUNNER = """
import os, runpy, sys

BLOCKED = set(os.environ["BLOCKED"].split(","))


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Refuse())
if os.environ.get("PATCH_CHECK"):
    import export.cli
    export.cli.missing_export_module = lambda demo: None
sys.argv = ["python -m export", *sys.argv[1:]]
runpy.run_module("export", run_name="__main__", alter_sys=True)
"""


def run_without(blocked: list[str], *args: str, cwd: Path, patch_check: bool = False
                ) -> subprocess.CompletedProcess:
    env = {**os.environ, "BLOCKED": ",".join(blocked), "PYTHONPATH": str(ROOT)}
    env.pop("PATCH_CHECK", None)
    if patch_check:
        env["PATCH_CHECK"] = "1"
    return subprocess.run([sys.executable, "-c", BLOCKING_RUNNER, *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)


def assert_names_the_extra(result: subprocess.CompletedProcess, module: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert lines[0].startswith("python -m export: error: "), lines[0]
    assert f"(no module {module})" in lines[0]
    assert "pip install 'tfserve[export]'" in lines[0] and TORCH_REQUIREMENT in lines[0]


@pytest.mark.parametrize("module", ["torch", "onnx", "onnxscript", "safetensors"])
def test_a_missing_module_of_the_extra_is_one_line_and_exit_2(module, tmp_path):
    out = tmp_path / "out"
    result = run_without([module], "--from-hf", str(tmp_path / "hf"), "--out", str(out),
                         cwd=tmp_path)
    assert_names_the_extra(result, module)
    assert not out.exists() and not (tmp_path / "artifacts").exists()


def test_the_whole_extra_missing_names_torch_first(tmp_path):
    """The base wheel: nothing of the extra; the demo export (no arguments) asked for."""
    result = run_without(list(EXPORT_EXTRA_MODULES), cwd=tmp_path)
    assert_names_the_extra(result, "torch")
    assert not (tmp_path / "artifacts").exists()


def test_num2words_is_needed_by_the_demo_only(tmp_path):
    assert_names_the_extra(run_without(["num2words"], cwd=tmp_path), "num2words")
    # a checkpoint of one's own goes on without it (to the next error: no such directory)
    result = run_without(["num2words"], "--from-hf", str(tmp_path / "hf"), cwd=tmp_path)
    assert result.returncode == 2 and "no module num2words" not in result.stderr
    assert str(tmp_path / "hf") in result.stderr and len(result.stderr.splitlines()) == 1


def test_an_import_inside_the_export_meets_the_same_answer(tmp_path):
    """The check before the work off: torch's absence met where export.sources imports it."""
    result = run_without(["torch"], "--from-hf", str(tmp_path / "hf"), cwd=tmp_path,
                         patch_check=True)
    assert_names_the_extra(result, "torch")


def test_a_module_outside_the_extra_is_not_blamed_on_it(tmp_path):
    """A missing module the extra does not provide stays the error it is (a traceback)."""
    result = run_without(["numpy"], "--from-hf", str(tmp_path / "hf"), cwd=tmp_path,
                         patch_check=True)
    assert result.returncode == 1
    assert "ModuleNotFoundError" in result.stderr and "tfserve[export]" not in result.stderr


def test_help_needs_no_extra(tmp_path):
    result = run_without(list(EXPORT_EXTRA_MODULES), "--help", cwd=tmp_path)
    assert result.returncode == 0 and "--from-hf" in result.stdout


def test_the_modules_and_the_pin_are_the_extra_and_readme_ones():
    """EXPORT_EXTRA_MODULES is pyproject's `export` extra; the torch pin is README's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extra = project["project"]["optional-dependencies"]["export"]
    assert {Requirement(requirement).name for requirement in extra} == \
        set(EXPORT_EXTRA_MODULES)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"`{TORCH_REQUIREMENT}`" in readme and "pip install 'tfserve[export]'" in readme
