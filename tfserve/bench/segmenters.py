"""Sentence segmenters compared on tfserve's gold set (tfserve/bench/text_gold.py): accuracy
per language (the share of cases split exactly as the gold), sentences per second on a long
English and a long Chinese text, installed size and licence.

    python -m tfserve.bench.segmenters

Candidates: tfserve's own splitter (tfserve.text.segmentation: sentencex plus its layout
rules), sentencex, pysbd and blingfire, each skipped when not installed. docs/documents.md holds
the table this prints and the choice made from it.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Callable

from tfserve.bench.text_gold import SENTENCES

Segmenter = Callable[[str, str], list[str]]


def _tfserve() -> Segmenter:
    from tfserve.text.segmentation import sentence_spans

    def segment(language: str, text: str) -> list[str]:
        return [text[a:b] for a, b in sentence_spans(text, 0, len(text), language)]
    return segment


def _sentencex() -> Segmenter:
    import sentencex
    return lambda language, text: list(sentencex.segment(language, text))


def _pysbd() -> Segmenter:
    import pysbd
    cache: dict[str, object] = {}

    def segment(language: str, text: str) -> list[str]:
        if language not in cache:
            try:
                cache[language] = pysbd.Segmenter(language=language, clean=False)
            except ValueError:  # a language pysbd has no rules for: its English ones
                cache[language] = pysbd.Segmenter(language="en", clean=False)
        return cache[language].segment(text)  # type: ignore[attr-defined]
    return segment


def _blingfire() -> Segmenter:
    import blingfire
    return lambda language, text: blingfire.text_to_sentences(text).split("\n")


CANDIDATES: dict[str, tuple[str | None, Callable[[], Segmenter]]] = {
    # name: (distribution whose size and licence are shown, loader)
    "tfserve (sentencex + rules)": ("sentencex", _tfserve),
    "sentencex": ("sentencex", _sentencex),
    "pysbd": ("pysbd", _pysbd),
    "blingfire": ("blingfire", _blingfire),
}


def installed(distribution: str) -> tuple[str, float, str]:
    """A distribution's version, installed size in MB and licence."""
    dist = importlib.metadata.distribution(distribution)
    paths = [str(dist.locate_file(file)) for file in dist.files or []]
    size = sum(os.path.getsize(path) for path in paths if os.path.isfile(path))
    metadata = dist.metadata
    licence = metadata["License-Expression"] or metadata["License"] or ""
    if not licence or len(licence) > 20:
        classifiers = [c.rsplit(" :: ", 1)[-1] for c in metadata.get_all("Classifier") or []
                       if c.startswith("License ::")]
        licence = classifiers[0] if classifiers else "?"
    return dist.version, size / 1e6, licence


def accuracy(segment: Segmenter) -> dict[str, float]:
    """language -> share of its cases split exactly into the gold sentences."""
    scores = {}
    for language, cases in SENTENCES.items():
        right = 0
        for text, gold in cases:
            try:
                got = [s.strip() for s in segment(language, text) if s.strip()]
            except Exception:  # noqa: BLE001 - a candidate failing a case scores it wrong
                got = []
            right += got == gold
        scores[language] = right / len(cases)
    return scores


def speed(segment: Segmenter, language: str, text: str, seconds: float = 0.5) -> float:
    """Sentences per second over `text`."""
    count = len(segment(language, text))
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        segment(language, text)
        runs += 1
    return count * runs / (time.perf_counter() - start)


def main() -> None:
    english = " ".join(text for text, _ in SENTENCES["en"]) * 20
    chinese = "".join(text for text, _ in SENTENCES["zh"]) * 20
    languages = list(SENTENCES)
    print("| segmenter | " + " | ".join(languages) + " | mean | sent/s en | sent/s zh "
          "| version | size MB | licence |")
    print("|---" * (len(languages) + 8) + "|")
    for name, (distribution, load) in CANDIDATES.items():
        try:
            segment = load()
        except ImportError:
            print(f"| {name} | not installed |")
            continue
        scores = accuracy(segment)
        mean = sum(scores.values()) / len(scores)
        version, size, licence = installed(distribution) if distribution else ("", 0.0, "")
        print(f"| {name} | " + " | ".join(f"{scores[lang]:.2f}" for lang in languages)
              + f" | {mean:.2f} | {speed(segment, 'en', english):,.0f} "
              f"| {speed(segment, 'zh', chinese):,.0f} | {version} | {size:.1f} | {licence} |")


if __name__ == "__main__":
    main()
