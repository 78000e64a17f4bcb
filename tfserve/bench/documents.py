"""What a document costs against its sentences sent as one batch (docs/benchmarks.md).

    python -m tfserve.bench.documents                       # the bundled demo, 300 sentences
    python -m tfserve.bench.documents --model DIR --sentences 600 --rounds 5

A document of N number sentences ("Three hundred and forty-two!"), in paragraphs of five
with blank lines between them and a list in every other paragraph, is translated two ways
on the same Translator, interleaved round by round, each going first in every other round
(the best round of each is reported):
- `translate`: its N sentences as one list (one request of N texts, batched by the
  Translator as any request is);
- `translate_document`: the document as one text, split, translated and joined back.
The ratio sentences / document is the document path's throughput against the batch's (the
goal: >= 0.95). The document path's own work, timed apart: planning (sentence splitting and
tokenizing), language detection on the whole text (done once per document for "auto") and
assembly; its share of the document's translation time (the goal: under 5%).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from tfserve.demo import data

PARAGRAPH = 5  # sentences per paragraph


def number_document(sentences: int, seed: int) -> str:
    """Paragraphs of sentence-cased number phrases with '.', '!' or '?', a list in every
    other paragraph: the layout a user pastes."""
    rng = random.Random(seed)
    paragraphs = []
    for start in range(0, sentences, PARAGRAPH):
        phrases = [data.sentence_pair(data.english(data.sample_number(rng)), "",
                                      rng.choice(".!?"))[0]
                   for _ in range(min(PARAGRAPH, sentences - start))]
        if (start // PARAGRAPH) % 2:
            paragraphs.append("\n".join(f"- {phrase}" for phrase in phrases))
        else:
            paragraphs.append(" ".join(phrases))
    return "\n\n".join(paragraphs) + "\n"


def best(seconds: list[float]) -> float:
    return min(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfserve.bench.documents",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="artifacts directory (default: the bundled demo, exported on "
                             "first use)")
    parser.add_argument("--sentences", type=int, default=300, help="sentences in the document")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all cores)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.sentences < 1 or args.rounds < 1:
        parser.error("--sentences and --rounds must be at least 1")

    from tfserve import Translator
    from tfserve.demo import default_artifacts
    from tfserve.text.documents import plan_document
    from tfserve.text.language_detection import detect_language

    model = args.model or default_artifacts()
    translator = Translator(model, intra_op_threads=args.threads)
    document = number_document(args.sentences, args.seed)
    def count_tokens(piece: str) -> int:  # as the serving core counts a piece
        return len(translator.tokenizer.encode_text(piece))

    plan = plan_document(document, language="en", max_tokens=translator.max_source_tokens,
                         count_tokens=count_tokens)
    sentences = list(plan.rows)

    times: dict[str, list[float]] = {"sentences": [], "document": [], "plan": [],
                                     "detect": [], "assemble": []}
    # warm-up: sessions, threads and arenas; the splitter's rules and the detector's model
    translator.translate(sentences)
    translator.translate_document(document)
    detect_language(document)
    def as_sentences() -> list[str]:
        return translator.translate(sentences)

    def as_document() -> Any:
        return translator.translate_document(document)

    for round_index in range(args.rounds):
        # the two ways take turns going first: a round's first call may find the caches and
        # the CPU's clock in another state than its second
        for name in ("sentences", "document")[::1 if round_index % 2 == 0 else -1]:
            started = time.perf_counter()
            if name == "sentences":
                batch = as_sentences()
            else:
                translated = as_document()
            times[name].append(time.perf_counter() - started)
        started = time.perf_counter()
        plan = plan_document(document, language="en", max_tokens=translator.max_source_tokens,
                             count_tokens=count_tokens)
        times["plan"].append(time.perf_counter() - started)
        started = time.perf_counter()
        detect_language(document)
        times["detect"].append(time.perf_counter() - started)
        started = time.perf_counter()
        assembled = plan.assemble(batch)
        times["assemble"].append(time.perf_counter() - started)
    if assembled.text != translated.text:
        print("the document's translation differs from its sentences' joined in its layout",
              file=sys.stderr)
        return 1
    overhead = best(times["plan"]) + best(times["detect"]) + best(times["assemble"])
    figures = {
        "model": str(model), "sentences": len(sentences), "characters": len(document),
        "rounds": args.rounds,
        "sentences_s": round(best(times["sentences"]), 4),
        "document_s": round(best(times["document"]), 4),
        "document_vs_sentences": round(best(times["sentences"]) / best(times["document"]), 3),
        "plan_ms": round(best(times["plan"]) * 1000, 2),
        "detect_ms": round(best(times["detect"]) * 1000, 2),
        "assemble_ms": round(best(times["assemble"]) * 1000, 2),
        "overhead_share": round(overhead / best(times["document"]), 4),
    }
    print(json.dumps(figures))
    print(f"document / sentences as one batch: {figures['document_vs_sentences']:.3f}x "
          f"throughput (goal >= 0.95); splitting + detection + assembly: "
          f"{100 * figures['overhead_share']:.2f}% of the document's time (goal < 5%)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
