"""Greedy exact-match accuracy of the demo on the 1,000 held-out numbers.

    python -m tfserve.demo.evaluate                   # eager PyTorch checkpoint
    python -m tfserve.demo.evaluate --backend onnx    # the exported demo on ONNX Runtime
    python -m tfserve.demo.evaluate --quantize int8   # the int8 export

Prints the accuracy and the first mistakes; exits 1 below --min-accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tfserve.demo import CHECKPOINT_DIR
from tfserve.demo.data import english, french, held_out_numbers
from tfserve.translator import Translator


def eager_translator(checkpoint: Path = CHECKPOINT_DIR) -> Translator:
    from tfserve.eager import EagerBackend
    from tfserve.model import load_checkpoint
    from tfserve.tokenizer import Tokenizer, TokenizerSpec

    spec = TokenizerSpec.from_dict(json.loads((checkpoint / "tokenizer.json").read_text()))
    return Translator.from_backend(EagerBackend(load_checkpoint(checkpoint)),
                                   Tokenizer(checkpoint, spec))


def accuracy(translator: Translator,
             numbers: list[int]) -> tuple[float, list[tuple[int, str, str]]]:
    """Fraction translated exactly, and the (number, expected, got) mistakes."""
    outputs = translator.translate([english(n) for n in numbers])
    mistakes = [(n, french(n), got) for n, got in zip(numbers, outputs) if got != french(n)]
    return 1 - len(mistakes) / len(numbers), mistakes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["eager", "onnx"], default="eager")
    parser.add_argument("--quantize", choices=["int8"], default=None,
                        help="evaluate an int8 export (implies --backend onnx)")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT_DIR)
    parser.add_argument("--limit", type=int, default=1000, help="held-out numbers to use")
    parser.add_argument("--min-accuracy", type=float, default=0.99)
    args = parser.parse_args(argv)

    numbers = held_out_numbers()[: args.limit]
    if args.backend == "eager" and not args.quantize:
        translator = eager_translator(args.checkpoint)
    else:
        import tempfile

        from export.cli import main as export_main

        out = Path(tempfile.mkdtemp(prefix="tfserve-demo-eval-")) / "artifacts"
        export_args = ["--checkpoint", str(args.checkpoint), "--out", str(out), "--quiet",
                       "--parity-samples", "0"]
        if args.quantize:
            export_args += ["--quantize", args.quantize]
        if export_main(export_args):
            return 1
        translator = Translator(out)
    started = time.perf_counter()
    score, mistakes = accuracy(translator, numbers)
    elapsed = time.perf_counter() - started
    label = args.quantize or args.backend
    print(f"{label}: greedy exact match {score:.2%} on {len(numbers)} held-out numbers "
          f"({len(mistakes)} wrong, {elapsed:.1f}s)")
    for number, expected, got in mistakes[:10]:
        print(f"  {number}: expected {expected!r}, got {got!r}")
    return 0 if score >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
