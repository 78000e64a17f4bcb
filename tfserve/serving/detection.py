"""The Detect RPC's work, whatever the transport (as LibreTranslate's /detect): each text's
language as an ISO 639 code with the detector's confidence, and the model's own code for it
where the model has language codes (tfserve.text.language_detection).

Every refusal is an InvalidArgument naming the text: too many texts, a blank one, one over
--max-document-characters (checked before the detector reads it), one whose language cannot
be decided (UndecidableLanguage's message).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from tfserve.serving.requests import INLINE_TOKENIZE_CHARS, field_errors
from tfserve.serving.settings import ServerConfig
from tfserve.serving.status import InvalidArgument
from tfserve.text.inputs import check_texts
from tfserve.text.language_detection import UndecidableLanguage, detect_language, model_language
from tfserve.text.tokenizer import Tokenizer
from tfserve.text.translation_inputs import model_languages


@dataclass(frozen=True)
class LanguageGuess:
    """One text's language: ISO 639 code, confidence in [0, 1], and the model's code for it
    ("" for a model without codes, or one without that language)."""

    language: str
    confidence: float
    model_language: str = ""


async def detect_texts(texts: Sequence[str], tokenizer: Tokenizer, config: ServerConfig
                       ) -> list[LanguageGuess]:
    """Each text's LanguageGuess, in order; large requests are read off the event loop."""
    with field_errors():
        checked = check_texts(list(texts), max_texts=config.max_texts_per_request)
    limit = config.max_document_characters
    for index, text in enumerate(checked):
        if len(text) > limit:
            raise InvalidArgument(f"texts[{index}] is {len(text)} characters, over the limit "
                                  f"of {limit} characters (--max-document-characters)")
    if sum(len(text) for text in checked) <= INLINE_TOKENIZE_CHARS:
        return _detect(checked, model_languages(tokenizer))
    return await asyncio.to_thread(_detect, checked, model_languages(tokenizer))


def _detect(texts: list[str], languages: list[str]) -> list[LanguageGuess]:
    guesses = []
    for index, text in enumerate(texts):
        try:
            found = detect_language(text)
        except UndecidableLanguage as exc:
            raise InvalidArgument(f"texts[{index}]: {exc}") from exc
        code = model_language(found.language, languages) if languages else None
        guesses.append(LanguageGuess(found.language, float(found.confidence), code or ""))
    return guesses
