"""Source language detection (tfserve.text.language_detection): the gold set's short and long
texts, undecidable texts, long documents, nothing fetched at run time, and the mapping of a
detected ISO code onto each model family's own codes."""

from __future__ import annotations

import socket

import pytest

from tfserve.bench.text_gold import LANGUAGES
from tfserve.text.language_detection import (
    Detection,
    UndecidableLanguage,
    detect_language,
    model_language,
)

CASES = [(language, text) for kind in ("short", "long") for language, text in LANGUAGES[kind]]


@pytest.mark.parametrize(("language", "text"), CASES,
                         ids=[f"{language}-{index}" for index, (language, _) in enumerate(CASES)])
def test_gold_languages(language: str, text: str) -> None:
    detection = detect_language(text)
    assert isinstance(detection, Detection)
    assert detection.language == language
    assert 0.0 <= detection.confidence <= 1.0


@pytest.mark.parametrize(("text", "reason"), [
    ("", "no letters"), ("   ", "no letters"), ("12345", "no letters"),
    ("3.14 + 2 = 5.14!", "no letters"),
    ("ok", "only 2 letters"), ("是", "only 1 letter"), ("A1 B2", "only 2 letters"),
    ("xxxxxxxx", "with confidence"),
])
def test_undecidable_texts_say_why_and_ask_for_source_language(text: str, reason: str) -> None:
    with pytest.raises(UndecidableLanguage, match=reason) as raised:
        detect_language(text)
    assert "source_language" in str(raised.value)
    assert isinstance(raised.value, ValueError)  # the serving layer's invalid-argument kind


def test_a_long_document_is_judged_on_all_of_it_at_a_bounded_cost() -> None:
    english = "The committee met to discuss the budget for the coming year. " * 2000
    french = "Le comité s'est réuni pour discuter du budget de l'année prochaine. " * 4000
    assert detect_language(english).language == "en"
    assert detect_language(english[:1000] + french).language == "fr"  # the body wins


def test_nothing_is_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("language detection tried to open a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert detect_language("Dies ist ein deutscher Satz über das Wetter.").language == "de"


@pytest.mark.parametrize(("detected", "codes", "expected"), [
    ("fr", ["eng_Latn", "fra_Latn", "deu_Latn"], "fra_Latn"),  # NLLB-200
    ("zh", ["yue_Hant", "zho_Hant", "zho_Hans"], "zho_Hant"),  # the model's first
    ("ar", ["arb_Arab", "ary_Arab"], "arb_Arab"),  # an individual code of the macrolanguage
    ("fa", ["pes_Arab"], "pes_Arab"),
    ("fr", ["en_XX", "fr_XX"], "fr_XX"),  # mBART
    ("fr", ["en", "fr", "de"], "fr"),  # M2M100
    ("de", [">>fra<<", ">>deu<<"], ">>deu<<"),  # Marian multi-target
    ("es", [">>es<<", ">>spa<<"], ">>es<<"),
    ("ceb", ["ceb_Latn"], "ceb_Latn"),  # no ISO 639-1 code
    ("deu", ["de_DE"], "de_DE"),  # a 639-3 code given
    ("ko", ["fr", "de"], None),
    ("no", ["nno_Latn", "nob_Latn"], "nob_Latn"),  # Norwegian: Bokmål first, then Nynorsk
    ("no", ["nn"], "nn"),
    ("nb", ["nno_Latn"], None),  # Bokmål is not Nynorsk
])
def test_model_language(detected: str, codes: list[str], expected: str | None) -> None:
    assert model_language(detected, codes) == expected
