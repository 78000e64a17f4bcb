"""The bundled demo translator: English number phrases to French.

`checkpoint/` holds the trained model (config.json, model.safetensors, tokenizer.json, the
SentencePiece model and samples.txt). `data` generates the phrases, `train` reproduces the
checkpoint and `evaluate` measures its exact-match accuracy on the held-out numbers.

`default_artifacts()` is where the CLI and the Python API find an exported demo: it exports
the checkpoint on first use (that step needs the `export` extra: torch and onnx).
"""

from __future__ import annotations

import hashlib
import os
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
    """Names the cached export: the checkpoint's files and the graph revision that made it."""
    from tfserve.manifest import GRAPH_REVISION

    digest = hashlib.sha256(f"graphs-{GRAPH_REVISION}".encode())
    for name in ("config.json", "model.safetensors"):
        digest.update((CHECKPOINT_DIR / name).read_bytes())
    return digest.hexdigest()[:12]


def default_artifacts(quiet: bool = True) -> Path:
    """The exported demo, exported now if this checkpoint was never exported here."""
    out = cache_root() / f"{DEMO_NAME}-{checkpoint_digest()}"
    if (out / "model.json").is_file():
        return out
    try:
        from export.cli import main as export_main
    except ImportError as exc:  # the serving-only install has no torch
        raise RuntimeError(
            "the demo model has not been exported yet and this install cannot export "
            f"({exc}); install the export extra (pip install 'tfserve[export]') or pass "
            "--model DIR with an artifacts directory"
        ) from exc
    print(f"exporting the demo model to {out} (first use) ...", file=sys.stderr, flush=True)
    args = ["--checkpoint", str(CHECKPOINT_DIR), "--out", str(out), "--force"]
    code = export_main(args + (["--quiet"] if quiet else []))
    if code != 0:
        raise RuntimeError(f"exporting the demo model failed (exit code {code})")
    return out
