"""A sentence longer than the model takes, split into pieces that each fit.

The model's source has a limit (max_tokens, counted by the tokenizer); a sentence over it
would be cut or refused. It is split instead, at the best boundaries first: after clause
punctuation (",", ";", ":", dashes, their CJK forms), then at whitespace, then, as a last
resort (a run of text with neither), between characters. Each piece is as long as fits: the
number of units (clauses, words, characters) a piece takes is found by binary search over the
real token count, so a 1 MB run costs O(n log n) characters counted, and one piece's text at
a time is held beyond the spans. The pieces' spans leave out the whitespace at their edges:
what lies between two pieces is layout, kept as it is when the translations are joined.

Pure Python.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable

# where a clause ends: the punctuation, then the whitespace after it (if any)
_CLAUSE_END = re.compile(r"[,;:\u2013\u2014\u3001\uff0c\uff1b\uff1a\u060c\u061b]+\s*")
_WORD = re.compile(r"\S+\s*")

Span = tuple[int, int]


def split_long(text: str, start: int, end: int, fits: Callable[[int, int], bool],
               max_characters: int) -> list[Span]:
    """text[start:end] (no whitespace at its edges) as spans that each satisfy `fits(start,
    end)` and hold at most `max_characters` characters, in order, covering every non-space
    character once; one span when it fits whole. A single character always forms a piece,
    even if `fits` refuses it (nothing smaller exists)."""
    if end - start <= max_characters and fits(start, end):
        return [(start, end)]
    return _pack(text, _units(_CLAUSE_END, text, start, end), fits, max_characters, words=False)


def _units(pattern: re.Pattern[str], text: str, start: int, end: int) -> list[Span]:
    """text[start:end] cut after each match of `pattern` (the match stays with the unit
    before it), so that the units cover the span without gaps."""
    units = []
    position = start
    for match in pattern.finditer(text, start, end):
        if match.end() > position and match.end() < end:
            units.append((position, match.end()))
            position = match.end()
    units.append((position, end))
    return units


def _pack(text: str, units: list[Span], fits: Callable[[int, int], bool],
          max_characters: int, words: bool) -> list[Span]:
    """Consecutive units grouped greedily into the longest pieces that fit; a unit that does
    not fit alone is cut into words (when `units` are clauses) or characters."""
    pieces: list[Span] = []
    index = 0
    while index < len(units):
        # the most units from `index` on that fit: binary search on the count, at most
        # the units within max_characters (so that no count looks at more than that)
        high = bisect.bisect_right(units, units[index][0] + max_characters, lo=index,
                                   key=lambda unit: _trimmed(text, *unit)[1]) - index
        low = 0
        while low < high:
            middle = (low + high + 1) // 2
            if fits(*_trimmed(text, units[index][0], units[index + middle - 1][1])):
                low = middle
            else:
                high = middle - 1
        if low:
            piece = _trimmed(text, units[index][0], units[index + low - 1][1])
            if piece[1] > piece[0]:
                pieces.append(piece)
            index += low
            continue
        unit_start, unit_end = _trimmed(text, *units[index])
        if unit_end > unit_start:
            if not words:
                words_of = _units(_WORD, text, unit_start, unit_end)
                pieces += _pack(text, words_of, fits, max_characters, words=True)
            else:
                pieces += _characters(unit_start, unit_end, fits, max_characters)
        index += 1
    return pieces


def _characters(start: int, end: int, fits: Callable[[int, int], bool],
                max_characters: int) -> list[Span]:
    """A run without whitespace cut into the longest runs of characters that fit (binary
    search on the length; a character that does not fit alone is a piece of its own)."""
    pieces = []
    while start < end:
        low, high = 1, min(max_characters, end - start)
        while low < high:
            middle = (low + high + 1) // 2
            if fits(start, start + middle):
                low = middle
            else:
                high = middle - 1
        pieces.append((start, start + low))
        start += low
    return pieces


def _trimmed(text: str, start: int, end: int) -> Span:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end
