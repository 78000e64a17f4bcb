"""Documents in, documents out (tfserve.text.documents): rows and spans of text documents,
the layout kept byte for byte, long sentences split within the model's limit and joined
again, limits and refusals. HTML is in test_html_document.py."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfserve.text.documents import (
    FORMATS,
    AssembledDocument,
    DocumentLimits,
    DocumentPlan,
    DocumentSegment,
    document_text,
    plan_document,
)


def _identity(plan: DocumentPlan) -> AssembledDocument:
    return plan.assemble(list(plan.rows))


def test_rows_are_sentences_and_the_layout_stays() -> None:
    text = ("Dr. Smith went home.  He ate 3.14 pies!\n\n"
            "- First item. Second one\n  1. nested item\n\t> quoted line\n")
    plan = plan_document(text)
    assert plan.rows == ["Dr. Smith went home.", "He ate 3.14 pies!", "First item.",
                         "Second one", "nested item", "quoted line"]
    assert [text[a:b] for a, b in plan.source_spans] == plan.rows
    assembled = plan.assemble([row.upper() for row in plan.rows])
    assert assembled.text == ("DR. SMITH WENT HOME.  HE ATE 3.14 PIES!\n\n"
                              "- FIRST ITEM. SECOND ONE\n  1. NESTED ITEM\n\t> QUOTED LINE\n")
    for segment, row in zip(assembled.segments, plan.rows):
        assert isinstance(segment, DocumentSegment)
        assert text[segment.source_start:segment.source_end] == row
        assert assembled.text[segment.target_start:segment.target_end] == row.upper()


def test_translations_of_other_lengths_move_the_target_spans() -> None:
    plan = plan_document("One. Two.\nThree.")
    assembled = plan.assemble(["Un, uno.", "Deux.", "Trois!"])
    assert assembled.text == "Un, uno. Deux.\nTrois!"
    assert [(s.target_start, s.target_end) for s in assembled.segments] == \
        [(0, 8), (9, 14), (15, 21)]


def test_split_sentences_off_gives_one_row_per_line() -> None:
    plan = plan_document("One. Two.\n\n  * Three. Four.", split_sentences=False)
    assert plan.rows == ["One. Two.", "Three. Four."]


@pytest.mark.parametrize("text", ["", "   ", "\n\n\t \n", "- \n1. \n"])
def test_empty_and_blank_text_has_no_rows(text: str) -> None:
    plan = plan_document(text)
    assert plan.rows == [] and plan.source_spans == []
    assert plan.assemble([]).text == text


def test_control_characters_are_layout_and_kept() -> None:
    text = "First.\x00Second\x1bthird.\r\nFourth.\x85Fifth."
    plan = plan_document(text)
    assert plan.rows == ["First.", "Second", "third.", "Fourth.", "Fifth."]
    assert _identity(plan).text == text


def test_lone_surrogates_are_refused_naming_text() -> None:
    with pytest.raises(ValueError, match=r"^text .*surrogate"):
        plan_document("Hello \ud800 world.")


def test_unknown_format_is_refused_naming_the_valid_ones() -> None:
    assert FORMATS == ("text", "html")
    with pytest.raises(ValueError, match=r"format must be one of text, html, got 'pdf'"):
        plan_document("x", format="pdf")


def test_limits() -> None:
    with pytest.raises(ValueError, match=r"^text has 11 characters, over the limit of 10"):
        plan_document("Hello world", limits=DocumentLimits(max_characters=10))
    with pytest.raises(ValueError, match=r"more than 2 sentences"):
        plan_document("One. Two. Three.", limits=DocumentLimits(max_sentences=2))
    assert len(plan_document("One. Two.", limits=DocumentLimits(max_sentences=2)).rows) == 2


def test_assemble_wants_one_translation_per_row() -> None:
    plan = plan_document("One. Two.")
    with pytest.raises(ValueError, match=r"translations: 2 expected \(one per row\), got 1"):
        plan.assemble(["Un."])


def test_languages_choose_the_rules() -> None:
    assert plan_document("你好。我很好！", language="zh").rows == ["你好。", "我很好！"]
    assert plan_document("M. Dupont est là. Il va bien.", language="fra_Latn").rows == \
        ["M. Dupont est là.", "Il va bien."]
    assert plan_document("Am 3. Oktober kam er. Gut.", language="deu").rows == \
        ["Am 3. Oktober kam er.", "Gut."]
    assert plan_document("วันนี้อากาศดี เราไปทะเลกัน", language="th").rows == \
        ["วันนี้อากาศดี", "เราไปทะเลกัน"]


def _words(piece: str) -> int:
    return len(piece.split())


def test_a_long_sentence_is_split_at_clauses_within_the_limit() -> None:
    sentence = ("When the rain stopped, the children ran outside, the dogs followed them, "
                "and the old man on the porch laughed at all of it.")
    plan = plan_document(sentence, max_tokens=8, count_tokens=_words)
    assert plan.rows == ["When the rain stopped, the children ran outside,",
                         "the dogs followed them,", "and the old man on the porch laughed",
                         "at all of it."]
    assert all(_words(row) <= 8 for row in plan.rows)
    assert " ".join(plan.rows) == sentence  # nothing cut, nothing repeated
    assert _identity(plan).text == sentence
    # a clause boundary is preferred to a word boundary
    assert plan.rows[0].endswith(",")


def test_a_run_without_whitespace_is_split_between_characters() -> None:
    plan = plan_document("x" * 25, max_tokens=10, count_tokens=len)
    assert plan.rows == ["x" * 10, "x" * 10, "x" * 5]
    assert "".join(plan.rows) == "x" * 25


def test_without_count_tokens_utf8_bytes_are_counted() -> None:
    plan = plan_document("é" * 10, max_tokens=10)  # 20 bytes
    assert plan.rows == ["é" * 5, "é" * 5]


@pytest.mark.parametrize("max_tokens", [0, -1, True])
def test_max_tokens_must_be_positive(max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        plan_document("Hello.", max_tokens=max_tokens)


def test_a_megabyte_without_punctuation_is_bounded_and_linear() -> None:
    limits = DocumentLimits()
    for text in ("word " * 200_000, "x" * 1_000_000):
        started = time.perf_counter()
        plan = plan_document(text, max_tokens=512, count_tokens=_words)
        elapsed = time.perf_counter() - started
        assert all(len(row) <= limits.max_row_characters for row in plan.rows)
        assert _identity(plan).text == text
        assert elapsed < 10, elapsed  # seconds, on a busy 2-core machine; ~1 s idle


# text made of what documents hold: words, sentence and clause punctuation, every kind of
# whitespace and line break, list markers, control characters, CJK and Thai
_PIECES = st.sampled_from(["Dr.", "Smith", "e.g.", "3.14", "word", "...", ".", "!", "?", ",",
                           ";", " ", "  ", "\t", "\n", "\n\n", "\r\n", "- ", "1. ", "* ",
                           "> ", "\x00", "\x0b", "\u2028", "\xa0", "。", "你好", "สวัสดี",
                           '"', "«", "»", "https://x.org/a.b", "A", "\u0301"])


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_PIECES | st.text(max_size=5), max_size=40),
       language=st.sampled_from([None, "en", "fr", "zh", "th", "ja", "deu", "xx"]),
       split=st.booleans(), max_tokens=st.sampled_from([None, 1, 3, 20]))
def test_layout_round_trips_for_any_text(pieces: list[str], language: str | None,
                                         split: bool, max_tokens: int | None) -> None:
    text = "".join(pieces)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # refused, tested above
    plan = plan_document(text, language=language, split_sentences=split,
                         max_tokens=max_tokens, count_tokens=_words if max_tokens else None)
    assert _identity(plan).text == text
    previous = 0
    for (start, end), row in zip(plan.source_spans, plan.rows):
        assert previous <= start < end and text[start:end] == row
        assert row == row.strip()
        previous = end
    if max_tokens:
        assert all(_words(row) <= max_tokens for row in plan.rows)


def test_document_text_is_what_language_detection_reads() -> None:
    assert document_text("Hello. World.\n") == "Hello. World.\n"
    page = ("<html><head><style>p {}</style><script>var x = 1;</script></head><body>"
            "<p>Bonjour <b>le</b> monde &amp; tous.</p><pre>code</pre><p>Salut.</p></body>")
    assert document_text(page, "html") == "Bonjour le monde & tous.\nSalut."
    with pytest.raises(ValueError, match="format"):
        document_text("x", "pdf")
