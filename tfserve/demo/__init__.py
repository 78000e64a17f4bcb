"""The bundled demo translator: English number phrases to French.

`checkpoint/` holds the trained model (config.json, model.safetensors, tokenizer.json, the
SentencePiece model and samples.txt). `data` generates the phrases, `train` reproduces the
checkpoint and `evaluate` measures its exact-match accuracy on the held-out numbers.

`default_artifacts()` is where the CLI and the Python API find an exported demo: it exports
the checkpoint on first use (that step needs the `export` extra: torch and onnx).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"
DEMO_NAME = "tfserve-demo-en-fr-numbers"


def cache_root() -> Path:
    """$TFSERVE_CACHE, else $XDG_CACHE_HOME/tfserve, else ~/.cache/tfserve."""
    if os.environ.get("TFSERVE_CACHE"):
        return Path(os.environ["TFSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tfserve"


def checkpoint_digest() -> str:
    """Names the cached export: the checkpoint's files (the tokenizer's too: the export copies
    them) and the graph revision that made it."""
    from tfserve.artifacts.manifest import GRAPH_REVISION

    digest = hashlib.sha256(f"graphs-{GRAPH_REVISION}".encode())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "source.spm"):
        digest.update((CHECKPOINT_DIR / name).read_bytes())
    return digest.hexdigest()[:12]


# what `python -m export` imports besides the serving path's dependencies (the export extra)
EXPORT_MODULES = ("torch", "onnx", "onnxscript", "safetensors")


class DemoUnavailableError(RuntimeError, ValueError):
    """The demo is not exported and this install cannot export it (no export extra).

    A ValueError too: at the command line it is a usage problem (pass --model DIR, or install
    the extra), which the CLI reports in one line with exit code 2.
    """


def export_unavailable() -> str | None:
    """Why this install cannot run `python -m export` ("No module named 'torch'"), or None."""
    for name in EXPORT_MODULES:
        # found, not imported: the export runs in a process of its own, and the serving
        # process never loads torch
        if importlib.util.find_spec(name) is None:
            return f"No module named '{name}'"
    return None


def default_artifacts(quiet: bool = True) -> Path:
    """The exported demo, exported now if this checkpoint was never exported here.

    Raises DemoUnavailableError before anything is printed when the export would fail for
    want of the export extra (a serving-only install: `pip install tfserve`).
    """
    out = cache_root() / f"{DEMO_NAME}-{checkpoint_digest()}"
    if (out / "model.json").is_file():
        return out
    # export.cli itself imports without torch; torch and onnx are imported when it runs, so
    # check them here, where a missing one is still a clear message and not a traceback
    missing = export_unavailable()
    if missing is not None:
        raise DemoUnavailableError(
            "the demo model is not exported yet and this install cannot export it "
            f"({missing}): pip install \"tfserve[export]\", or pass --model DIR with an "
            "exported model")
    print(f"exporting the demo model to {out} (first use) ...", file=sys.stderr, flush=True)
    # `python -m export` in a process of its own: the serving package never imports export
    # (imports run one way, from export down to tfserve), and torch stays out of this process
    args = [sys.executable, "-m", "export", "--checkpoint", str(CHECKPOINT_DIR), "--out",
            str(out), "--force"]
    code = subprocess.run(args + (["--quiet"] if quiet else []), check=False).returncode
    if code != 0:
        raise RuntimeError(f"exporting the demo model failed (exit code {code})")
    return out
