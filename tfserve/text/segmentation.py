"""Sentence splitting of plain text: blocks (lines, list items) and the sentences inside them.

A document's layout is everything that is not a sentence: the whitespace between sentences,
newlines, blank lines, indentation, list markers ("- ", "1. ", "* ", "> ") and control
characters. This module only finds the sentences, as [start, end) character spans of the
text; whatever lies between two spans is layout and is kept byte for byte by the caller.

- A block is one line: a line break (any of str.splitlines' separators) or another control
  character ends it, as DeepL's default does. A hard-wrapped paragraph is therefore
  translated line by line (docs/documents.md says so).
- A list marker or a Markdown heading/quote mark at the start of a line is layout, not text.
- Inside a block, sentences come from `sentencex` (Wikimedia's rule-based segmenter: about
  300 languages, each with its abbreviation list, falling back through related languages to
  English rules); tfserve/bench/segmenters.py measured it against pysbd and blingfire.

Pure Python over sentencex's Rust core: linear in the text's length.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import sentencex

# ISO 639-3 (and 639-2/B) codes of the languages whose segmenter rules sentencex names by
# their ISO 639-1 code; a 639-3 code without an entry goes to sentencex as is (it knows many)
ISO_639_3_TO_1 = {
    "afr": "af", "amh": "am", "ara": "ar", "arb": "ar", "asm": "as", "aze": "az", "bel": "be",
    "ben": "bn", "bod": "bo", "tib": "bo", "bos": "bs", "bul": "bg", "cat": "ca", "ces": "cs",
    "cze": "cs", "cym": "cy", "wel": "cy", "dan": "da", "deu": "de", "ger": "de", "ell": "el",
    "gre": "el", "eng": "en", "epo": "eo", "est": "et", "ekk": "et", "eus": "eu", "baq": "eu",
    "fas": "fa", "per": "fa", "pes": "fa", "fin": "fi", "fra": "fr", "fre": "fr", "gle": "ga",
    "glg": "gl", "guj": "gu", "heb": "he", "hin": "hi", "hrv": "hr", "hun": "hu", "hye": "hy",
    "arm": "hy", "ind": "id", "isl": "is", "ice": "is", "ita": "it", "jpn": "ja", "kat": "ka",
    "geo": "ka", "kaz": "kk", "khm": "km", "kan": "kn", "kor": "ko", "kir": "ky", "lao": "lo",
    "lit": "lt", "lav": "lv", "lvs": "lv", "mkd": "mk", "mac": "mk", "mal": "ml", "mon": "mn",
    "khk": "mn", "mar": "mr", "msa": "ms", "may": "ms", "zsm": "ms", "mya": "my", "bur": "my",
    "nep": "ne", "npi": "ne", "nld": "nl", "dut": "nl", "nob": "nb", "nno": "nn", "nor": "no",
    "ori": "or", "ory": "or", "pan": "pa", "pol": "pl", "pus": "ps", "pbt": "ps", "por": "pt",
    "ron": "ro", "rum": "ro", "rus": "ru", "sin": "si", "slk": "sk", "slo": "sk", "slv": "sl",
    "som": "so", "sqi": "sq", "alb": "sq", "als": "sq", "srp": "sr", "swe": "sv", "swa": "sw",
    "swh": "sw", "tam": "ta", "tel": "te", "tgk": "tg", "tha": "th", "tgl": "tl", "tur": "tr",
    "ukr": "uk", "urd": "ur", "uzb": "uz", "uzn": "uz", "vie": "vi", "yid": "yi", "zho": "zh",
    "chi": "zh", "cmn": "zh", "yue": "zh",
}

# what ends a block: str.splitlines' line separators and the other C0/C1 control characters
# (a control character inside a sentence would only confuse the tokenizer); tab is spacing
_BLOCK_BREAK = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]+")
# layout at the start of a line: indentation, then a list marker ("- ", "* ", "+ ", "• ",
# "1. ", "2) ", "iv. " is not one: too easily a word), a Markdown heading ("## ") or a
# quote mark ("> "), each followed by whitespace
_LINE_PREFIX = re.compile(
    r"[ \t]*(?:(?:[-*+\u2022\u2023\u25e6\u2043\u2219\u00b7]|\d{1,9}[.)]|#{1,6}|>+)[ \t]+)*")


def segmenter_language(language: str | None) -> str:
    """The code sentencex knows `language` by: ISO 639-1 codes as they are, ISO 639-3 codes
    through ISO_639_3_TO_1, a model's own code ("fra_Latn", "fr_XX", "zh-Hant") by its
    language part; None or "" gives English rules, sentencex's default."""
    if not language:
        return "en"
    base = re.split(r"[_\-]", language.strip(), maxsplit=1)[0].lower()
    return ISO_639_3_TO_1.get(base, base) or "en"


def block_spans(text: str, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
    """The [start, end) spans of the blocks of text[start:end]: each line without its
    layout prefix (indentation, list marker) and trailing whitespace; empty ones left out."""
    end = len(text) if end is None else end
    position = start
    while position < end:
        brk = _BLOCK_BREAK.search(text, position, end)
        line_end = brk.start() if brk else end
        prefix = _LINE_PREFIX.match(text, position, line_end)
        block_start = prefix.end() if prefix else position
        block_end = _rstrip(text, block_start, line_end)
        if block_end > block_start:
            yield block_start, block_end
        position = brk.end() if brk else end


def sentence_spans(text: str, start: int, end: int,
                   language: str | None = None) -> list[tuple[int, int]]:
    """The sentences of the block text[start:end] as [start, end) spans of `text`, each
    without the whitespace around it."""
    spans = []
    position = start
    for piece in sentencex.segment(segmenter_language(language), text[start:end]):
        piece_start, piece_end = _strip(text, position, position + len(piece))
        if piece_end > piece_start:
            spans.append((piece_start, piece_end))
        position += len(piece)
    if position != end:  # sentencex's pieces cover the block; if they ever do not: one row
        return [_strip(text, start, end)]
    return spans


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    """[start, end) narrowed to leave out whitespace at either end."""
    while start < end and text[start].isspace():
        start += 1
    return start, _rstrip(text, start, end)


def _rstrip(text: str, start: int, end: int) -> int:
    while end > start and text[end - 1].isspace():
        end -= 1
    return end
