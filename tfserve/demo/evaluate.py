"""Greedy exact-match accuracy of the demo on the 1,000 held-out numbers, per English form.

    python -m tfserve.demo.evaluate                   # eager PyTorch checkpoint
    python -m tfserve.demo.evaluate --backend onnx    # the exported demo on ONNX Runtime
    python -m tfserve.demo.evaluate --quantize int8   # the int8 export
    python -m tfserve.demo.evaluate --forms canonical no-hyphens

Each held-out number is written in each lower-case form of data.SOURCE_FORMS: num2words'
English ("twenty-one thousand, three hundred and five") and the ways people type it (no
hyphens, no commas, no "and", none of them); then as a sentence, in each form of
data.SENTENCE_FORMS ("Twenty-one thousand, three hundred and five!" -> "Vingt et un mille
trois cent cinq !"). Prints the accuracy per form and its first mistakes, then the mean of
the lower-case forms and of the sentence forms; exits 1 when any form is below
--min-accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tfserve.demo import CHECKPOINT_DIR
from tfserve.demo.data import FORMS, SENTENCE_FORMS, SOURCE_FORMS, form_pair, held_out_numbers
from tfserve.translator import Translator


def eager_translator(checkpoint: Path = CHECKPOINT_DIR) -> Translator:
    from tfserve.model import load_checkpoint
    from tfserve.model.eager import EagerBackend
    from tfserve.text.tokenizer import Tokenizer, TokenizerSpec

    spec = TokenizerSpec.from_dict(json.loads((checkpoint / "tokenizer.json").read_text()))
    return Translator.from_backend(EagerBackend(load_checkpoint(checkpoint)),
                                   Tokenizer(checkpoint, spec))


def accuracy(translator: Translator, numbers: list[int],
             form: str = "canonical") -> tuple[float, list[tuple[str, str, str]]]:
    """Fraction translated exactly with the English in `form` (a data.FORMS name), and the
    (source, expected, got) mistakes."""
    pairs = [form_pair(n, form) for n in numbers]
    outputs = translator.translate([source for source, _ in pairs])
    mistakes = [(source, expected, got)
                for (source, expected), got in zip(pairs, outputs) if got != expected]
    return 1 - len(mistakes) / len(numbers), mistakes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["eager", "onnx"], default="eager")
    parser.add_argument("--quantize", choices=["int8"], default=None,
                        help="evaluate an int8 export (implies --backend onnx)")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT_DIR)
    parser.add_argument("--limit", type=int, default=1000, help="held-out numbers to use")
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=FORMS,
                        help="English forms to score")
    parser.add_argument("--min-accuracy", type=float, default=0.995,
                        help="the least accuracy each form must reach")
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
    label = args.quantize or args.backend
    scores: dict[str, float] = {}
    for form in args.forms:
        started = time.perf_counter()
        scores[form], mistakes = accuracy(translator, numbers, form)
        elapsed = time.perf_counter() - started
        print(f"{label}: {form}: greedy exact match {scores[form]:.2%} on {len(numbers)} "
              f"held-out numbers ({len(mistakes)} wrong, {elapsed:.1f}s)", flush=True)
        for source, expected, got in mistakes[:5]:
            print(f"  {source!r}: expected {expected!r}, got {got!r}")
    for kind, forms in (("lower-case", SOURCE_FORMS), ("sentence", SENTENCE_FORMS)):
        scored = [scores[form] for form in forms if form in scores]
        if scored:
            print(f"{label}: {kind} forms: mean greedy exact match "
                  f"{sum(scored) / len(scored):.2%}", flush=True)
    return 0 if min(scores.values()) >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
