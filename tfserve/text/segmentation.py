"""Sentence splitting of plain text: blocks (lines, list items) and the sentences inside them.

A document's layout is everything that is not a sentence: the whitespace between sentences,
newlines, blank lines, indentation, list markers ("- ", "1. ", "* ", "> ") and control
characters. This module only finds the sentences, as [start, end) character spans of the
text; whatever lies between two spans is layout and is kept byte for byte by the caller.

- A block is one line: a line break (any of str.splitlines' separators) or another control
  character ends it, as DeepL's default does; except that a hard-wrapped sentence stays one
  block: a line going on in lower case after one line break continues the line before it,
  when that one does not end a sentence (docs/documents.md).
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

from tfserve.text.iso_codes import iso_language

# what ends a block: str.splitlines' line separators and the other C0/C1 control characters
# (a control character inside a sentence would only confuse the tokenizer); tab is spacing
_BLOCK_BREAK = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]+")
# layout at the start of a line: indentation, then a list marker ("- ", "* ", "+ ", "• ",
# "1. ", "2) ", "iv. " is not one: too easily a word), a Markdown heading ("## ") or a
# quote mark ("> "), each followed by whitespace
_LINE_PREFIX = re.compile(
    r"[ \t]*(?:(?:[-*+\u2022\u2023\u25e6\u2043\u2219\u00b7]|\d{1,9}[.)]|#{1,6}|>+)[ \t]+)*")

# what a hard-wrapped line may end with when the next line continues its sentence
_CONTINUING = frozenset(",-\u2010\u2013\u2014\u3001\uff0c")
WINDOW = 8192  # characters of a block given to sentencex at once

# abbreviations sentencex's rules lack, measured on the gold set: a break after one is undone
_ABBREVIATIONS = {
    "fr": frozenset({"M.", "MM.", "Mme.", "Mlle.", "Mgr.", "Pr.", "cf.", "p.", "St."}),
    "hi": frozenset({"डॉ.", "श्री.", "सं."}),
}
# Japanese: 「...。」と言った - a quote closed and carried on by a particle is one sentence
_JAPANESE_QUOTE_END = re.compile(r"[」』]$")
_JAPANESE_PARTICLE = re.compile(r"(?:と|って|とか|など|の|を|が|は)")
# scripts written without sentence punctuation, where a space between two of its letters
# ends a sentence (Thai, Lao); the space also separates phrases, which then become rows
_SPACE_SEPARATED = {"th": re.compile(r"(?<=[\u0e00-\u0e7f])\s+(?=[\u0e00-\u0e7f])"),
                    "lo": re.compile(r"(?<=[\u0e80-\u0eff])\s+(?=[\u0e80-\u0eff])")}


def segmenter_language(language: str | None) -> str:
    """The code sentencex knows `language` by (its ISO 639-1 code where one exists; see
    iso_language); None or "" gives English rules, sentencex's default."""
    return iso_language(language) if language else "en"


def block_spans(text: str, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
    """The [start, end) spans of the blocks of text[start:end]: each line without its
    layout prefix (indentation, list marker) and trailing whitespace; empty ones left out.
    A hard-wrapped sentence is one block: a line that goes on, after a single line break and
    indentation only, with a lower-case letter continues the line before it when that one
    ends in a letter, digit, comma or dash (not a sentence's end)."""
    end = len(text) if end is None else end
    position = start
    pending: tuple[int, int] | None = None  # the last block, which the next line may continue
    single_break = False  # whether one "\n" or "\r\n" alone ended the pending block's line
    while position < end:
        brk = _BLOCK_BREAK.search(text, position, end)
        line_end = brk.start() if brk else end
        prefix = _LINE_PREFIX.match(text, position, line_end)
        prefix_end = prefix.end() if prefix else position
        block_start, block_end = _strip(text, prefix_end, line_end)
        if block_end > block_start:
            if pending is not None and single_break and _continues_line(
                    text, pending[1], position, prefix_end, block_start):
                pending = (pending[0], block_end)
            else:
                if pending is not None:
                    yield pending
                pending = (block_start, block_end)
            single_break = brk is not None and brk.group() in ("\n", "\r\n")
        else:
            single_break = False
        position = brk.end() if brk else end
    if pending is not None:
        yield pending


def _continues_line(text: str, previous_end: int, line_start: int, prefix_end: int,
                    block_start: int) -> bool:
    """Whether a line (from line_start; its text at block_start) continues the block that
    ends at previous_end: indentation only before it (no list marker), a lower-case start,
    and no sentence end before it."""
    if text[line_start:prefix_end].strip(" \t") or not text[block_start].islower():
        return False
    last = text[previous_end - 1]
    return last.isalnum() or last in _CONTINUING


def sentence_spans(text: str, start: int, end: int,
                   language: str | None = None) -> list[tuple[int, int]]:
    """The sentences of the block text[start:end] as [start, end) spans of `text`, each
    without the whitespace around it: sentencex's, then tfserve's few rules for what it
    measurably misses (tfserve/bench/segmenters.py): abbreviations it lacks, Japanese quotes
    followed by a particle, and Thai's space-separated sentences."""
    code = segmenter_language(language)
    spans: list[tuple[int, int]] = []
    # sentencex is quadratic on some inputs (a long run of paired quotes: 140k characters of
    # 「...」 take seconds), so a long block goes through it a window at a time: the window's
    # sentences but the last are kept, and the next window starts at that last one (it may
    # continue past the window); a window with one sentence is kept whole (a long sentence,
    # which long_sentences then cuts). Linear, and the same result below WINDOW characters.
    position = start
    while position < end:
        window_end = min(position + WINDOW, end)
        pieces = list(sentencex.segment(code, text[position:window_end]))
        if sum(map(len, pieces)) != window_end - position:
            pieces = [text[position:window_end]]  # sentencex's pieces cover their input
        if window_end < end and len(pieces) > 1:
            pieces.pop()  # may be cut by the window: it starts the next one
        for piece in pieces:
            piece_start, piece_end = _strip(text, position, position + len(piece))
            if piece_end > piece_start:
                if spans and _continues(text, spans[-1], piece_start, code):
                    spans[-1] = (spans[-1][0], piece_end)
                else:
                    spans.append((piece_start, piece_end))
            position += len(piece)
    if code in _SPACE_SEPARATED:
        pattern = _SPACE_SEPARATED[code]
        spans = [part for span in spans for part in _space_separated(pattern, text, *span)]
    return spans


def _continues(text: str, previous: tuple[int, int], start: int, code: str) -> bool:
    """Whether the sentence at `start` continues the one at `previous` (a wrong break)."""
    # the previous sentence's last characters only: merges chain ("M. M. M. ...")
    before = text[max(previous[0], previous[1] - 16):previous[1]]
    words = before.rsplit(None, 1)
    if words and words[-1] in _ABBREVIATIONS.get(code, ()):
        return True
    return (code == "ja" and previous[1] == start and bool(_JAPANESE_QUOTE_END.search(before))
            and bool(_JAPANESE_PARTICLE.match(text, start)))


def _space_separated(pattern: re.Pattern[str], text: str, start: int,
                     end: int) -> list[tuple[int, int]]:
    """A Thai (Lao) sentence cut at the spaces between two of its letters."""
    spans = []
    for match in pattern.finditer(text, start, end):
        spans.append((start, match.start()))
        start = match.end()
    spans.append((start, end))
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
