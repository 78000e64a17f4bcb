"""HTML documents (tfserve.text.html_document through plan_document(format="html")): what is
a row, what is left untouched, inline tags projected onto translations, well-formed output,
and broken HTML (hypothesis tag soup) never failing."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfserve.text.documents import DocumentLimits, plan_document
from tfserve.text.html_document import VOID_ELEMENTS


class _Tags(HTMLParser):
    """The start and end tags of a document in order, and whether they nest properly."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.stack: list[str] = []
        self.well_formed = True

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self.tags.append(tag)
        if tag not in VOID_ELEMENTS:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        self.tags.append("/" + tag)
        if not self.stack or self.stack.pop() != tag:
            self.well_formed = False


def tags(document: str) -> _Tags:
    parser = _Tags()
    parser.feed(document)
    parser.close()
    parser.well_formed = parser.well_formed and not parser.stack
    return parser


def _translate(document: str, table: dict[str, str]) -> str:
    plan = plan_document(document, format="html")
    missing = [row for row in plan.rows if row not in table]
    assert not missing, missing
    return plan.assemble([table[row] for row in plan.rows]).text


def test_inline_tags_stay_in_the_sentence_and_come_back_around_the_right_words() -> None:
    document = "<p>Hello <b>big</b> world.</p>"
    plan = plan_document(document, format="html")
    assert plan.rows == ["Hello big world."]
    assert plan.source_spans == [(3, 26)]  # from "Hello" to "world."
    assert plan.assemble(["Bonjour grand monde."]).text == \
        "<p>Bonjour <b>grand</b> monde.</p>"
    # a tagged word found unchanged in the translation is tagged where it is (anchor)
    assert _translate("<p>I use <a href='x'>Linux</a> daily.</p>",
                      {"I use Linux daily.": "Tous les jours, j'utilise Linux."}) == \
        "<p>Tous les jours, j'utilise <a href='x'>Linux</a>.</p>"


def test_nested_inline_tags_stay_nested() -> None:
    out = _translate("<p>A <b>very <i>big</i> dog</b> barks.</p>",
                     {"A very big dog barks.": "Un très gros chien aboie."})
    assert tags(out).well_formed
    assert tags(out).tags == ["p", "b", "i", "/i", "/b", "/p"]
    assert out == "<p>Un <b>très <i>gros</i> chien</b> aboie.</p>"


def test_block_elements_end_rows_and_markup_is_kept() -> None:
    document = ("<!DOCTYPE html><html><head><title>Tom &amp; Jerry</title>"
                "<style>p { color: red }</style><script>var s = 'Hi. There.';</script>"
                "</head><body><h1 class=\"x\">Title</h1><!-- a comment. -->"
                "<ul><li>One.</li><li>Two<br>Three</li></ul>"
                "<table><tr><td>Cell</td></tr></table></body></html>")
    plan = plan_document(document, format="html")
    assert plan.rows == ["Tom & Jerry", "Title", "One.", "Two", "Three", "Cell"]
    assert plan.assemble(plan.rows).text == document
    upper = plan.assemble([row.upper() for row in plan.rows]).text
    assert upper == document.replace("Tom &amp; Jerry", "TOM &amp; JERRY").replace(
        ">Title<", ">TITLE<").replace("One.", "ONE.").replace("Two<", "TWO<").replace(
        "Three", "THREE").replace("Cell", "CELL")


def test_untouched_elements() -> None:
    document = ("<p translate=\"no\">Keep. This.</p><div class=\"a notranslate\">Also "
                "<b>kept</b>.</div><pre>  code  here. </pre><textarea>x. y.</textarea>"
                "<p>Do translate.</p>")
    plan = plan_document(document, format="html")
    assert plan.rows == ["Do translate."]
    assert plan.assemble(["Traduire."]).text == document.replace("Do translate.", "Traduire.")


@pytest.mark.parametrize(("document", "rows"), [
    # an untranslated element ends where HTML ends it, not at the end of the page
    ("<p translate=no>Keep this.<p>Translate this.", ["Translate this."]),
    ("<ul><li translate=no>Keep.<li>Go.</ul><p>After.</p>", ["Go.", "After."]),
    ("<div><p translate=no>Keep.</div><p>After.</p>", ["After."]),
    ("<p translate=no>Keep.<div>Block.</div>", ["Block."]),
    ("<div translate=no>Keep <div>nested.</div> still.</div>Out.", ["Out."]),
])
def test_untranslated_elements_end_where_html_ends_them(document: str,
                                                        rows: list[str]) -> None:
    plan = plan_document(document, format="html")
    assert plan.rows == rows
    assert plan.assemble(plan.rows).text == document


def test_inline_code_and_translate_no_come_back_as_they_were() -> None:
    document = "<p>Run <code>ls -l</code> now, with <span translate=no>Acme</span>.</p>"
    plan = plan_document(document, format="html")
    assert plan.rows == ["Run ls -l now, with Acme."]
    out = plan.assemble(["Lancez ls -l maintenant, avec Acme."]).text
    assert out == ("<p>Lancez <code>ls -l</code> maintenant, avec "
                   "<span translate=no>Acme</span>.</p>")
    # the model changed the code's text: the original element takes the projected place
    out = plan.assemble(["Lancez LS maintenant, avec ACME."]).text
    assert out.count("<code>ls -l</code>") == 1 and out.count("<span translate=no>Acme</span>")
    assert tags(out).well_formed


def test_entities_are_decoded_in_rows_and_escaped_in_the_output() -> None:
    document = "<p>Fish &amp; chips &lt;3 &eacute;t&#233; caf&#xE9;.</p>"
    plan = plan_document(document, format="html")
    assert plan.rows == ["Fish & chips <3 été café."]
    assert plan.assemble(["Poisson & frites <3 > tout."]).text == \
        "<p>Poisson &amp; frites &lt;3 &gt; tout.</p>"


def test_whitespace_inside_a_block_collapses_in_the_row() -> None:
    document = "<p>\n  Hello\n   <b>big</b>\n  world.  Bye.\n</p>"
    plan = plan_document(document, format="html")
    assert plan.rows == ["Hello big world.", "Bye."]
    out = plan.assemble(["Salut grand monde.", "Ciao."]).text
    assert out == "<p>\n  Salut <b>grand</b> monde.  Ciao.\n</p>"


def test_a_tag_across_two_sentences_stays_balanced() -> None:
    document = "<p>One <b>two. Three</b> four.</p>"
    plan = plan_document(document, format="html")
    assert plan.rows == ["One two.", "Three four."]
    out = plan.assemble(["Un deux.", "Trois quatre."]).text
    assert tags(out).tags == ["p", "b", "/b", "/p"] and tags(out).well_formed
    assert out == "<p>Un <b>deux. Trois</b> quatre.</p>"


def test_split_sentences_off_gives_one_row_per_block() -> None:
    plan = plan_document("<p>One. Two.</p><p>Three.</p>", format="html",
                         split_sentences=False)
    assert plan.rows == ["One. Two.", "Three."]


def test_a_long_html_sentence_is_split_within_the_limit() -> None:
    document = "<p>Alpha beta, <b>gamma delta</b> epsilon zeta eta theta.</p>"
    plan = plan_document(document, format="html", max_tokens=3,
                         count_tokens=lambda piece: len(piece.split()))
    assert all(len(row.split()) <= 3 for row in plan.rows)
    assert " ".join(plan.rows) == "Alpha beta, gamma delta epsilon zeta eta theta."
    out = plan.assemble([row.upper() for row in plan.rows]).text
    assert tags(out).well_formed and tags(out).tags == ["p", "b", "/b", "/p"]


@pytest.mark.parametrize("document", ["", "   ", "<p></p>", "<br><hr/>", "<!-- x -->",
                                      "<script>x = 1;</script>"])
def test_documents_without_text_have_no_rows(document: str) -> None:
    plan = plan_document(document, format="html")
    assert plan.rows == []
    assert plan.assemble([]).text == document


@pytest.mark.parametrize("document", [
    "<p>Unclosed <b>bold. Text", "</b>stray</i> end tags.", "<p <b>x", "<a href='>bad",
    "<![CDATA[x]]> text", "<!x> y", "&#xZZ; &#99999999; &bogus text", "<<>>", "</>",
    "<?php echo 1 ?> after", "<svg><p>in svg</p></svg> out", "<div><p>a</div>b</p>",
    "e.g.<code><</b>&amp;",  # inline code that a parent's end tag closes
])
def test_broken_html_never_fails_and_keeps_its_markup(document: str) -> None:
    plan = plan_document(document, format="html")
    for translations in ([row.upper() for row in plan.rows], [row[::-1] for row in plan.rows]):
        out = plan.assemble(translations).text
        assert tags(out).tags == tags(document).tags


_SOUP = st.lists(st.sampled_from([
    "<p>", "</p>", "<b>", "</b>", "<i>", "</i>", "<a href='x.y'>", "</a>", "<br>", "<img/>",
    "<div>", "</div>", "<li>", "<code>", "</code>", "<span translate=no>", "</span>",
    "<script>", "</script>", "<pre>", "</pre>", "<!-- c. -->", "<!DOCTYPE html>", "&amp;",
    "&lt;", "&#233;", "&x", "<", ">", "&", "<p", "\"", " ", "  ", "\n", "Hello", "world",
    "Dr.", ".", "!", "?", "3.14", "你好。", "e.g.", "x"]) | st.text(max_size=4), max_size=40)


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(pieces=_SOUP, split=st.booleans(), max_tokens=st.sampled_from([None, 2]))
def test_tag_soup_never_fails_and_keeps_markup_in_order(pieces: list[str], split: bool,
                                                       max_tokens: int | None) -> None:
    document = "".join(pieces)
    try:
        document.encode("utf-8")
    except UnicodeEncodeError:
        return
    plan = plan_document(document, format="html", split_sentences=split,
                         max_tokens=max_tokens,
                         count_tokens=(lambda piece: len(piece.split())) if max_tokens else None)
    for (start, end), row in zip(plan.source_spans, plan.rows):
        assert 0 <= start < end <= len(document) and row == row.strip() and row
    for translations in (plan.rows, [row[::-1] for row in plan.rows],
                         ["x" for _ in plan.rows], ["" for _ in plan.rows]):
        out = plan.assemble(translations).text
        before, after = tags(document), tags(out)
        assert after.tags == before.tags
        if before.well_formed:
            assert after.well_formed


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(words=st.lists(st.sampled_from(["Hello", "big", "world", "the", "a", "dog", "Linux",
                                       "3.14", "café", "你好", "end.", "Why?"]),
                      min_size=1, max_size=12),
       marks=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 4),
                                st.sampled_from(["b", "i", "a", "em"])), max_size=4),
       target=st.lists(st.sampled_from(["Bonjour", "grand", "monde", "le", "chien", "Linux",
                                        "x"]), max_size=15),
       split=st.booleans())
def test_well_formed_input_gives_well_formed_output(words: list[str],
                                                    marks: list[tuple[int, int, str]],
                                                    target: list[str], split: bool) -> None:
    # nested, non-overlapping tags over a block's words (elements may span sentences), a
    # random translation for every row
    opens: dict[int, list[str]] = {}
    closes: dict[int, list[str]] = {}
    taken: list[tuple[int, int]] = []
    marks_names: dict[tuple[int, int], str] = {}
    for first, length, name in marks:
        last = min(first + length, len(words)) - 1
        if first > last or (first, last) in marks_names or any(
                not (last < a or first > b or (a <= first and last <= b)
                     or (first <= a and b <= last)) for a, b in taken):
            continue
        marks_names[(first, last)] = name
        taken.append((first, last))
    # at one word, outer elements (longer spans) open first and close last
    for first, last in sorted(taken, key=lambda span: (span[0], -span[1])):
        name = marks_names[(first, last)]
        opens.setdefault(first, []).append(name)
        closes.setdefault(last, []).insert(0, name)
    body = " ".join("".join(f"<{n}>" for n in opens.get(i, [])) + word
                    + "".join(f"</{n}>" for n in closes.get(i, []))
                    for i, word in enumerate(words))
    document = f"<p>{body}.</p>"
    assert tags(document).well_formed
    plan = plan_document(document, format="html", split_sentences=split)
    out = plan.assemble([" ".join(target)] * len(plan.rows)).text
    assert tags(out).well_formed
    assert sorted(tags(out).tags) == sorted(tags(document).tags)


def test_segments_point_at_each_rendered_row() -> None:
    document = "<h1>Title</h1><p>Hello <b>big</b> world. Bye.</p>"
    plan = plan_document(document, format="html")
    assembled = plan.assemble(["Titre", "Bonjour grand monde.", "Salut."])
    spans = [(s.source_start, s.source_end) for s in assembled.segments]
    assert spans == plan.source_spans
    assert [document[a:b] for a, b in spans] == ["Title", "Hello <b>big</b> world.", "Bye."]
    assert [assembled.text[s.target_start:s.target_end] for s in assembled.segments] == \
        ["Titre", "Bonjour <b>grand</b> monde.", "Salut."]


def test_too_many_rows_stop_the_plan_early() -> None:
    with pytest.raises(ValueError, match="more than 3 sentences"):
        plan_document("<p>a</p>" * 10_000, format="html",
                      limits=DocumentLimits(max_sentences=3))
    assert len(plan_document("<p>a</p>" * 3, format="html",
                             limits=DocumentLimits(max_sentences=3)).rows) == 3


def test_render_row_is_the_rows_span_of_the_assembled_document() -> None:
    plan = plan_document("<p>Hello <b>big</b> world.</p><p>Second &amp; last.</p>",
                         format="html")
    translations = [f"<{row.upper()}> & more" for row in plan.rows]
    assembled = plan.assemble(translations)
    for index, segment in enumerate(assembled.segments):
        assert plan.render_row(index, translations[index]) == (
            assembled.text[segment.target_start:segment.target_end])
