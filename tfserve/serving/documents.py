"""A translate request's texts as documents, the same for the server and the Python API.

Every text of a request is a document unless the request turns sentence splitting off
(`split_sentences=False`): it is split into sentences (tfserve.text.documents.plan_document,
as "text" or "html"), and each sentence becomes one row, an ordinary input of the request's
scheduler job, so that a long document fills the continuous batch and shares it with every
other client's rows. The rows' hypotheses are joined back into the text's layout
(DocumentPlan.assemble), with each segment's source and target character spans.

    documents = plan_documents(tokenizer, texts, DocumentRequest(...), max_source_tokens,
                               limits)
    job = scheduler.submit_translate(documents.sources, options_per_row)
    answers = documents.results(hypotheses_of_each_row)     # one TranslatedText per text

The n-best list of a document (num_return_sequences = n): hypothesis k is the document made
of every segment's k-th hypothesis (a segment with fewer gives its last), its token ids the
segments' ids one after the other and its score the sum of theirs; hypotheses[0] is the
document of every segment's best. Each segment carries its own n alternatives.

A sentence longer than the model's source limit is split into pieces within it (the
tokenizer counts), never cut or refused; with splitting off, a text is one row as before (over
the limit: refused, or cut with `truncate`).

`source_language="auto"` (a multilingual model only) detects each document's language once,
from its whole text (tfserve.text.language_detection), and maps it to the model's code; the
language found and the detector's confidence come back with the answer.

Every refusal is an InvalidArgument (a ValueError) naming the field and the limit. Nothing
here knows a transport, a scheduler or an event loop.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tfserve.serving.status import InvalidArgument
from tfserve.text.documents import (
    FORMATS,
    DocumentLimits,
    DocumentPlan,
    document_text,
    plan_document,
)
from tfserve.text.language_detection import (
    UndecidableLanguage,
    detect_language,
    model_language,
)
from tfserve.text.tokenizer import Tokenizer
from tfserve.text.translation_inputs import model_languages, source_ids

AUTO = "auto"  # source_language: detect each document's language
DEFAULT_FORMAT = FORMATS[0]  # "text": what an empty format means
# a model's code -> the ISO 639 code the sentence splitter takes: its leading letters
# ("fra_Latn" -> "fra", "fr_XX" -> "fr", "en" -> "en")
_ISO_PREFIX = re.compile(r"^([a-z]{2,3})(?:[_-]|$)")


class Hypothesis(Protocol):
    """What a row's hypothesis offers (tfserve.serving.results.TextHypothesis, the
    Translator's Translation)."""

    text: str
    token_ids: list[int]
    score: float


H = TypeVar("H", bound=Hypothesis)


@dataclass(frozen=True)
class DocumentRequest:
    """How a request's texts are read: split into sentences (None: the default, true), as
    "text" or "html" ("" : text), in `source_language` (a model's code, "auto", or "" for
    the model's default)."""

    split_sentences: bool | None = None
    format: str = ""
    source_language: str = ""

    @property
    def splits(self) -> bool:
        return self.split_sentences is not False


@dataclass(frozen=True)
class DetectedLanguage:
    """A document's language as detected: the model's code for it (`language`), the ISO
    639 code the detector gave, and its confidence in [0, 1]."""

    language: str
    iso: str
    confidence: float


@dataclass(frozen=True)
class TranslatedSegment:
    """One segment of a translated document: its spans ([start, end) in code points) in the
    source text and in the best document's text, and its own hypotheses, best first (given
    when the request asked for several)."""

    source_start: int
    source_end: int
    target_start: int
    target_end: int
    hypotheses: list[Any] = field(default_factory=list)  # of the row's hypothesis type


@dataclass(frozen=True)
class TranslatedText:
    """The answer for one text: its hypotheses (documents, for a split text: module
    docstring), its segments (none when it was not split) and the language detected (with
    source_language "auto")."""

    hypotheses: list[Any]  # DocumentHypothesis for a split text, else the row's type
    segments: list[TranslatedSegment] = field(default_factory=list)
    detected: DetectedLanguage | None = None


@dataclass(frozen=True)
class DocumentHypothesis:
    """A document's hypothesis: its assembled text, the segments' token ids one after the
    other, the sum of their scores."""

    text: str
    token_ids: list[int]
    score: float


@dataclass
class Documents:
    """A request's texts planned as rows: `sources` (the token ids of every row, text after
    text, segment after segment), which text and segment each row is (`row_of`), each
    text's plan (None for a text not split: one row, as given) and detected language."""

    sources: list[list[int]]
    row_of: list[tuple[int, int]]
    first_row: list[int]
    plans: list[DocumentPlan | None]
    detected: list[DetectedLanguage | None]

    @property
    def count(self) -> int:
        """How many texts (inputs) the request holds."""
        return len(self.plans)

    def rows_of(self, index: int) -> range:
        """The rows of text `index`."""
        end = self.first_row[index + 1] if index + 1 < self.count else len(self.sources)
        return range(self.first_row[index], end)

    def layout(self, index: int) -> tuple[list[str], str]:
        """(the layout text in front of each segment, the layout after the last) of text
        `index`: what a stream sends around the segments' translations. For a text not
        split: ([""], "")."""
        plan = self.plans[index]
        if plan is None:
            return [""], ""
        bare = plan.assemble([""] * len(plan.rows))
        separators, end = [], 0
        for segment in bare.segments:
            separators.append(bare.text[end:segment.target_start])
            end = segment.target_end
        return separators, bare.text[end:]

    def streams_tokens(self, index: int) -> bool:
        """Whether text `index`'s segments can be streamed token by token: a plain text's
        translation goes into the layout as it is; an HTML row's is escaped and its inline
        markup projected onto the whole translation, so it is sent once it is complete."""
        plan = self.plans[index]
        return plan is None or plan.format == DEFAULT_FORMAT

    def rendered(self, index: int, segment: int, translation: str) -> str:
        """A segment's translation as the assembled document holds it (for HTML: escaped,
        its markup projected; the text layer renders each row on its own, so a stream
        renders one row without assembling the whole document each time)."""
        plan = self.plans[index]
        return translation if plan is None else plan.render_row(segment, translation)

    def result(self, index: int, rows: Sequence[Sequence[H]]) -> TranslatedText:
        """Text `index`'s answer from the hypotheses of its rows (in order)."""
        plan = self.plans[index]
        if plan is None:
            return TranslatedText(list(rows[0]), [], self.detected[index])
        count = max(len(found) for found in rows)
        documents: list[DocumentHypothesis] = []
        segments: list[TranslatedSegment] = []
        for k in range(count):
            chosen = [found[min(k, len(found) - 1)] for found in rows]
            assembled = plan.assemble([hypothesis.text for hypothesis in chosen])
            documents.append(DocumentHypothesis(
                assembled.text, [token for h in chosen for token in h.token_ids],
                float(sum(h.score for h in chosen))))
            if k == 0:
                segments = [TranslatedSegment(
                    span.source_start, span.source_end, span.target_start, span.target_end,
                    list(found) if count > 1 else [])
                    for span, found in zip(assembled.segments, rows)]
        return TranslatedText(documents, segments, self.detected[index])

    def results(self, rows: Sequence[Sequence[H]]) -> list[TranslatedText]:
        """Every text's answer from the hypotheses of every row (the job's results)."""
        return [self.result(index, [rows[row] for row in self.rows_of(index)])
                for index in range(self.count)]


def check_format(value: str) -> str:
    """The format a request names ("" : text), or InvalidArgument naming `format`."""
    given = value or DEFAULT_FORMAT
    if given not in FORMATS:
        shown = value if len(value) <= 40 else f"{value[:40]}..."
        raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {shown!r}")
    return given


def splitter_language(code: str) -> str | None:
    """The ISO 639 code the sentence splitter takes for a model's language code (None when
    the code does not start with one)."""
    match = _ISO_PREFIX.match(code or "")
    return match.group(1) if match else None


def detect(tokenizer: Tokenizer, text: str, field_name: str = "texts[0]",
           format_name: str = DEFAULT_FORMAT) -> DetectedLanguage:
    """A document's language for source_language "auto": detected from the whole text (an
    HTML page's text, without its markup, scripts and styles), as the model's code.
    InvalidArgument for a model without language codes, a text whose language cannot be
    decided (UndecidableLanguage's message) and a language the model lacks (naming it)."""
    languages = model_languages(tokenizer)
    if not languages:
        raise InvalidArgument("source_language 'auto' needs a multilingual model (one with "
                              "language codes, ModelInfo.languages); this model has none: "
                              "leave source_language empty")
    try:
        found = detect_language(document_text(text, format_name))
    except UndecidableLanguage as exc:
        raise InvalidArgument(f"source_language 'auto': {field_name}: {exc}") from exc
    code = model_language(found.language, languages)
    if code is None:
        raise InvalidArgument(f"source_language 'auto': {field_name} was detected as "
                              f"{found.language!r} (confidence {found.confidence:.2f}), a "
                              "language this model does not translate from")
    return DetectedLanguage(code, found.language, float(found.confidence))


def plan_documents(tokenizer: Tokenizer, texts: Sequence[str], request: DocumentRequest,
                   max_source_tokens: int, limits: DocumentLimits,
                   truncate: bool = False, model_source_language: str = "") -> Documents:
    """The rows of a request's (checked, non-blank) texts: each text split into sentences
    and tokenized in its language's frame, or, with splitting off, tokenized whole as
    before. InvalidArgument naming the field and the limit for: an unknown format, "html"
    without splitting, a text over limits.max_characters (checked before any other work),
    more rows than limits.max_sentences for the whole request, and the language errors of
    `detect` and of the model's codes."""
    format_name = check_format(request.format)
    if format_name != DEFAULT_FORMAT and not request.splits:
        raise InvalidArgument(f"format {format_name!r} needs split_sentences (the markup is "
                              "read to find the text to translate)")
    auto = request.source_language == AUTO
    sources: list[list[int]] = []
    row_of: list[tuple[int, int]] = []
    first_row: list[int] = []
    plans: list[DocumentPlan | None] = []
    detected: list[DetectedLanguage | None] = []
    for index, text in enumerate(texts):
        where = f"texts[{index}]"
        if request.splits and len(text) > limits.max_characters:
            # before detection and splitting: the work they do grows with the text
            raise InvalidArgument(f"{where} is {len(text)} characters, over the limit of "
                                  f"{limits.max_characters} characters per document "
                                  "(--max-document-characters)")
        found = detect(tokenizer, text, where, format_name) if auto else None
        code = found.language if found is not None else request.source_language
        first_row.append(len(sources))
        detected.append(found)
        if not request.splits:
            plans.append(None)
            sources += _tokenized(tokenizer, [text], code, max_source_tokens, truncate,
                                  model_source_language, where)
            row_of.append((index, 0))
            continue
        with _named(where):
            # a model without codes takes only its own source language: framed as none
            before, after = tokenizer.frame(
                code or None if tokenizer.languages is not None else None)
            plan = plan_document(
                text, format=format_name,
                language=splitter_language(code or model_source_language),
                split_sentences=True, max_tokens=max_source_tokens - len(before) - len(after),
                count_tokens=lambda piece: len(tokenizer.encode_text(piece)),
                limits=DocumentLimits(limits.max_characters, limits.max_sentences))
        if not plan.rows:
            raise InvalidArgument(f"{where} holds no text to translate (only markup or "
                                  "layout)")
        if len(sources) + len(plan.rows) > limits.max_sentences:
            raise InvalidArgument(f"texts split into more than {limits.max_sentences} "
                                  "sentences, over the limit of sentences per request "
                                  "(--max-document-sentences)")
        plans.append(plan)
        sources += _tokenized(tokenizer, plan.rows, code, max_source_tokens, False,
                              model_source_language, where)
        row_of += [(index, segment) for segment in range(len(plan.rows))]
    return Documents(sources, row_of, first_row, plans, detected)


class _named:
    """Turn a ValueError (the text layer's, the tokenizer's) into InvalidArgument prefixed
    with the text's field name (`texts[i]: ...`); an InvalidArgument passes as it is."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: object) -> bool:
        if exc is None or isinstance(exc, InvalidArgument) or not isinstance(exc, ValueError):
            return False
        message = str(exc)
        if not message.startswith(("source_language", "texts")):
            message = f"{self.where}: {message}"
        raise InvalidArgument(message) from exc


def _tokenized(tokenizer: Tokenizer, rows: Sequence[str], code: str, max_source_tokens: int,
               truncate: bool, model_source_language: str, where: str) -> list[list[int]]:
    """source_ids of a text's rows; an error names the text (`texts[i]`), and the row when
    the text has several."""
    try:
        return source_ids(tokenizer, rows, code or None, max_source_tokens, truncate,
                          model_source_language)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("texts["):  # texts[j] is the j-th row of this text
            row, _, rest = message[len("texts["):].partition("]")
            place = where if len(rows) == 1 else f"{where} (segment {row})"
            message = f"{place}{rest}"
        raise InvalidArgument(message) from exc
