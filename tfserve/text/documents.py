"""Documents in, documents out: a text or an HTML page planned as rows to translate, and
the translations assembled back into the document's layout.

`plan_document` finds the sentences (tfserve.text.segmentation for text,
tfserve.text.html_document for HTML), splits a sentence longer than the model takes
(tfserve.text.long_sentences), and returns a `DocumentPlan`: the rows, one model input each,
with the span of each in the original. `DocumentPlan.assemble` puts one translation per row
back where its row was; everything between rows is kept byte for byte (whitespace, newlines,
list markers; for HTML every tag, attribute, comment and untranslated element), so that
`plan.assemble(plan.rows).text == text` for text documents.

This is the one place every front end and the Python API plan documents (docs/documents.md);
the serving core sends the rows down as ordinary rows of the continuous batch. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tfserve.text.html_document import RowMarkup, html_rows
from tfserve.text.long_sentences import split_long
from tfserve.text.segmentation import block_spans, sentence_spans

FORMATS = ("text", "html")


@dataclass(frozen=True)
class DocumentLimits:
    """What one document may hold, checked before any work is done for it."""

    max_characters: int = 1_000_000  # the document's length, in characters
    max_sentences: int = 10_000  # rows (sentences and pieces of long ones)
    # a row's length in characters whatever the token limit (and when none is given): what
    # bounds a run with no sentence punctuation, so that no row is larger than a model takes
    max_row_characters: int = 4_096


@dataclass(frozen=True)
class DocumentSegment:
    """Where one row is: its characters [source_start, source_end) in the original document
    and [target_start, target_end) in the assembled one (for HTML, the span of its rendered
    translation, inline markup included)."""

    source_start: int
    source_end: int
    target_start: int
    target_end: int


@dataclass(frozen=True)
class AssembledDocument:
    """The translated document, and where each row went."""

    text: str
    segments: list[DocumentSegment]


class DocumentPlan:
    """The rows of a document, in order, and how to put their translations back."""

    def __init__(self, text: str, format: str, rows: list[str],
                 source_spans: list[tuple[int, int]],
                 markup: list[RowMarkup] | None = None) -> None:
        self.text = text  # the original document
        self.format = format
        self.rows = rows  # what to translate, in order: one model input each
        self.source_spans = source_spans  # each row's [start, end) in `text`
        # HTML: each row's inline markup, projected onto its translation; None for text
        self._markup = markup

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"DocumentPlan(format={self.format!r}, rows={len(self.rows)})"

    def render_row(self, index: int, translation: str) -> str:
        """Row `index`'s translation as the assembled document holds it: a text row's as it
        is; an HTML row's escaped, with the row's inline tags projected onto it. A stream
        renders each row as it finishes, without assembling the whole document each time."""
        return self._markup[index].render(translation) if self._markup else translation

    def assemble(self, translations: list[str]) -> AssembledDocument:
        """The document with each row's span replaced by its translation (for HTML: escaped,
        with the row's inline tags projected onto it)."""
        if len(translations) != len(self.rows):
            raise ValueError(f"translations: {len(self.rows)} expected (one per row), got "
                             f"{len(translations)}")
        out: list[str] = []
        segments = []
        cursor = 0
        length = 0
        for index, ((start, end), translation) in enumerate(zip(self.source_spans,
                                                               translations)):
            if not isinstance(translation, str):
                raise ValueError(f"translations[{index}] must be a string, got "
                                 f"{type(translation).__name__}")
            gap = self.text[cursor:start]
            rendered = self.render_row(index, translation)
            out += (gap, rendered)
            target_start = length + len(gap)
            length = target_start + len(rendered)
            segments.append(DocumentSegment(start, end, target_start, length))
            cursor = end
        out.append(self.text[cursor:])
        return AssembledDocument("".join(out), segments)


def plan_document(text: str, *, format: str = "text", language: str | None = None,
                  split_sentences: bool = True, max_tokens: int | None = None,
                  count_tokens: Callable[[str], int] | None = None,
                  limits: DocumentLimits = DocumentLimits()) -> DocumentPlan:
    """The rows to translate of a document `text` in `format` ("text" or "html").

    language: the source language's code (ISO 639-1 or 639-3, or a model's own code such as
    "fra_Latn"), for the sentence splitter's rules; None: its default (English) rules.
    split_sentences: one row per sentence (default), or one per block of text (line; HTML
    block element).
    max_tokens, count_tokens: the model's source limit and the tokenizer's count of a piece
    of text; a row over it is split at clause punctuation, else whitespace, else between
    characters, into pieces that each fit. Without count_tokens a piece's UTF-8 length is
    its count (never fewer than a byte-level or SentencePiece tokenizer's, bar special
    tokens).
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if len(text) > limits.max_characters:
        raise ValueError(f"text has {len(text)} characters, over the limit of "
                         f"{limits.max_characters} (max_characters)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        # a lone UTF-16 surrogate (JSON's "\ud800"): no tokenizer or wire can carry it
        raise ValueError(f"text is not valid text: an unpaired surrogate at character "
                         f"{error.start}") from None
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens!r}")
    count = count_tokens or _utf8_length

    def pieces(source: str, start: int, end: int) -> list[tuple[int, int]]:
        """source[start:end] (one sentence) in pieces that each fit the model."""
        def fits(piece_start: int, piece_end: int) -> bool:
            return max_tokens is None or count(source[piece_start:piece_end]) <= max_tokens
        return split_long(source, start, end, fits, limits.max_row_characters)

    markup: list[RowMarkup] | None = None
    rows: list[str] = []
    spans: list[tuple[int, int]] = []
    if format == "html":
        html = html_rows(text, language, split_sentences, pieces, limits.max_sentences)
        rows = [row.text for row in html]
        spans = [row.span for row in html]
        markup = [row.markup for row in html]
    else:
        for block_start, block_end in block_spans(text):
            parts = (sentence_spans(text, block_start, block_end, language)
                     if split_sentences else [(block_start, block_end)])
            for start, end in parts:
                for piece_start, piece_end in pieces(text, start, end):
                    rows.append(text[piece_start:piece_end])
                    spans.append((piece_start, piece_end))
            if len(rows) > limits.max_sentences:  # early: a huge document stops here
                raise _too_many(limits)
    if len(rows) > limits.max_sentences:
        raise _too_many(limits)
    return DocumentPlan(text, format, rows, spans, markup)


def document_text(text: str, format: str = "text") -> str:
    """A document's translatable text, to detect its language on before planning it
    (detect_language(document_text(text, format))): a text document as it is; an HTML one's
    blocks of text, decoded, one a line, without markup, scripts, styles or untranslated
    elements."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format == "text":
        return text
    rows = html_rows(text, None, False, lambda source, start, end: [(start, end)])
    return "\n".join(row.text for row in rows)


def _too_many(limits: DocumentLimits) -> ValueError:
    return ValueError(f"text has more than {limits.max_sentences} sentences, the limit "
                      "(max_sentences); send it in parts")


def _utf8_length(piece: str) -> int:
    return len(piece.encode("utf-8"))
