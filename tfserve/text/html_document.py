"""HTML documents: the translatable sentences of a page, and the page rebuilt around their
translations with its markup where it was.

Parsing is the standard library's `html.parser` (lenient on broken HTML, no dependency, the
same tokenizer rules as the HTML spec's for tags, comments and raw text in script/style): it is
used only to find where each piece of markup starts in the source, so that everything which is
not translated text (tags with their attributes, comments, doctype, entities outside text,
script, style, pre, code, and elements with translate="no") stays byte for byte.

- A *block* is the text between two block boundaries: a block element's tag (p, div, li, td,
  h1-h6, br, ...), an untouched element (script, style, pre, textarea, translate="no" blocks),
  the document's start and end. Inline tags (b, i, a, span, ...) do not end a block.
- A block's text is decoded (entities) and its ASCII whitespace runs collapsed to one space, as
  a browser renders it; the sentences of that text are the rows. A row's source span is the
  extent of its text in the HTML, from its first character to its last.
- The markup inside a sentence's extent (inline tags, comments, images, inline code) is kept as
  a small tree over the row's characters; after translation it is projected onto the
  translated text (`RowMarkup.render`): first by a lexical anchor (the tagged text found
  unchanged in the translation: names, numbers, code, URLs), else proportionally, snapped to
  word boundaries. Tags are rendered by walking the tree, so every tag pair that was matched in
  the source comes back properly nested and closed; tags the source left unmatched are kept
  as they were, in their order. docs/documents.md gives the reasons and the limits.
- Inline code and inline translate="no" elements stay in the row (the model sees the whole
  sentence) and come back as their original source at the place their text is found.

Pure Python.
"""

from __future__ import annotations

import bisect
import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser

from tfserve.text.segmentation import sentence_spans

# elements whose start and end tags end a block (and void ones that do: br, hr)
BLOCK_ELEMENTS = frozenset("""
address article aside blockquote body br caption center col colgroup dd details dialog dir div
dl dt fieldset figcaption figure footer form frame frameset h1 h2 h3 h4 h5 h6 head header hgroup
hr html iframe legend li link main menu meta nav noframes noscript object ol optgroup option p
section select summary table tbody td tfoot th thead title tr ul video audio canvas body
""".split())
# elements left untouched with everything inside them, ending a block
OPAQUE_BLOCKS = frozenset("script style pre textarea template svg math".split())
# inline elements left untouched with everything inside them, inside a sentence
OPAQUE_INLINE = frozenset("code kbd samp var".split())
# elements whose end tag HTML lets out: the next of their kind closes them
_OPTIONAL_END = frozenset("p li dt dd td th tr option optgroup thead tbody tfoot caption "
                          "colgroup rt rp".split())
VOID_ELEMENTS = frozenset(
    "area base br col embed hr img input link meta param source track wbr".split())
_ENTITY = re.compile(r"&(?:#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[A-Za-z][A-Za-z0-9]*;?)")
_ASCII_SPACE = " \t\n\r\f"
_BOUNDARY_SEARCH = 256  # characters looked at either side for a word boundary
_STACK_SEARCH = 64  # open elements an end tag looks through for its start (bounds the work)


def _untranslatable(name: str, attrs: list[tuple[str, str | None]]) -> bool:
    """translate="no" (HTML), or Google Translate's class="notranslate"."""
    for key, value in attrs:
        if key == "translate" and (value or "").strip().lower() == "no":
            return True
        if key == "class" and "notranslate" in (value or "").split():
            return True
    return False


# -- markup over a row -----------------------------------------------------------------------

@dataclass
class Node:
    """Markup inside a row: a matched element (`open`/`close` tags around the row characters
    [start, end)), a marker (`open` only: a comment, a void or unmatched tag, at `start`), or
    an opaque element (`open` is its whole source, standing for the row characters
    [start, end), which it replaces in the translation)."""

    kind: str  # "element", "marker", "opaque"
    open: str
    close: str = ""
    start: int = 0
    end: int = 0
    children: list[Node] = field(default_factory=list)


@dataclass
class RowMarkup:
    """The markup inside one row's extent, as a tree over the row's text."""

    text: str
    children: list[Node]

    def render(self, translation: str) -> str:
        """The translation, HTML-escaped, with this row's markup projected onto it."""
        if not self.children:
            return html.escape(translation, quote=False)
        out: list[str] = []
        _render(self.children, self.text, translation, 0, len(self.text), 0, len(translation),
                out)
        return "".join(out)


def _render(children: list[Node], source: str, target: str, source_start: int,
            source_end: int, lo: int, hi: int, out: list[str]) -> None:
    """Emits target[lo:hi] with `children` (covering source[source_start:source_end]) placed
    at their projections, in order."""
    cursor = lo
    for child in children:
        start, end = _project(child, source, target, source_start, source_end, cursor, hi)
        out.append(html.escape(target[cursor:start], quote=False))
        if child.kind == "element":
            out.append(child.open)
            _render(child.children, source, target, child.start, child.end, start, end, out)
            out.append(child.close)
        else:
            out.append(child.open)  # a marker (start == end) or an opaque element's source
        cursor = end
    out.append(html.escape(target[cursor:hi], quote=False))


def _project(node: Node, source: str, target: str, source_start: int, source_end: int,
             lo: int, hi: int) -> tuple[int, int]:
    """The target span of a node's source span, within target[lo:hi]."""
    # proportional: the node's place in its parent's source span, onto the parent's target
    scale = (hi - lo) / max(source_end - source_start, 1)
    start = min(max(lo + round((node.start - source_start) * scale), lo), hi)
    end = min(max(lo + round((node.end - source_start) * scale), start), hi)
    words = source[node.start:node.end].strip(_ASCII_SPACE)
    if words and node.end > node.start:
        anchor = _anchor(words, target, lo, hi, start)
        if anchor is not None:
            return anchor
    if " " not in target[lo:hi]:
        return start, end  # no word boundaries to snap to (CJK, Thai, one word)
    if node.end == node.start:
        # a marker: at a word's start where the source has it after a space (or first),
        # else at a word's end ("Three</b> four": an end tag stays on its word)
        after_space = node.start == 0 or source[node.start - 1].isspace()
        at = _nearest_boundary(target, start, lo, hi, word_start=after_space)
        return at, at
    start = _nearest_boundary(target, start, lo, hi, word_start=True)
    end = max(_nearest_boundary(target, end, start, hi, word_start=False), start)
    if end == start and start < hi:  # a tagged word is never dropped to nothing
        end = _nearest_boundary(target, start + 1, start + 1, hi, word_start=False)
        end = max(end, start + 1)
    return start, end


def _anchor(words: str, target: str, lo: int, hi: int, near: int) -> tuple[int, int] | None:
    """The occurrence of `words` in target[lo:hi] nearest to `near` that does not cut a word
    (the first 16 occurrences looked at)."""
    best = None
    at = target.find(words, lo, hi)
    for _ in range(16):
        if at < 0:
            break
        end = at + len(words)
        before_ok = at == lo or not (target[at - 1].isalnum() and words[0].isalnum())
        after_ok = end == hi or not (target[end].isalnum() and words[-1].isalnum())
        if before_ok and after_ok and (best is None or abs(at - near) < abs(best - near)):
            best = at
        at = target.find(words, at + 1, hi)
    return None if best is None else (best, best + len(words))


def _nearest_boundary(target: str, at: int, lo: int, hi: int, word_start: bool) -> int:
    """The word start (or end) in target[lo:hi] nearest to `at`."""
    def is_boundary(position: int) -> bool:
        if word_start:
            return (position == lo or target[position - 1].isspace()) and \
                (position == hi or not target[position].isspace())
        return (position == hi or target[position].isspace()) and \
            (position == lo or not target[position - 1].isspace())
    for distance in range(min(hi - lo, _BOUNDARY_SEARCH) + 1):
        for position in (at - distance, at + distance):
            if lo <= position <= hi and is_boundary(position):
                return position
    return at


# -- parsing ---------------------------------------------------------------------------------

@dataclass
class _Token:
    """One parser event: its kind, tag name (for tags) and source span."""

    kind: str  # "text", "start", "end", "startend", "other" (comment, decl, pi)
    start: int
    end: int = 0
    name: str = ""
    untranslatable: bool = False


class _Tokens(HTMLParser):
    """The source spans of a document's tokens (ends filled in from the next start)."""

    def __init__(self, document: str) -> None:
        # convert_charrefs=True: text comes as data events whatever its entities (the
        # entities are decoded from the source by _characters); with False, an incomplete
        # "&#" near the end makes the parser take the rest of the document, tags included,
        # as text
        super().__init__(convert_charrefs=True)
        self.document = document
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", document)]
        self.tokens: list[_Token] = []

    def _offset(self) -> int:
        line, column = self.getpos()
        return self.line_starts[line - 1] + column

    def _add(self, kind: str, name: str = "", untranslatable: bool = False) -> None:
        start = self._offset()
        if kind == "text" and self.tokens and self.tokens[-1].kind == "text":
            return  # text runs continue (entities, split data)
        self.tokens.append(_Token(kind, start, name=name, untranslatable=untranslatable))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._add("start", tag, _untranslatable(tag, attrs))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._add("startend", tag, _untranslatable(tag, attrs))

    def handle_endtag(self, tag: str) -> None:
        self._add("end", tag)

    def handle_data(self, data: str) -> None:
        self._add("text")

    def handle_comment(self, data: str) -> None:
        self._add("other")

    def handle_decl(self, decl: str) -> None:
        self._add("other")

    def handle_pi(self, data: str) -> None:
        self._add("other")

    def unknown_decl(self, data: str) -> None:
        self._add("other")


def tokenize(document: str) -> list[_Token]:
    """The document's tokens with their source spans, covering it without gaps. Text inside
    script/style comes as text tokens after their start tag (raw text mode)."""
    parser = _Tokens(document)
    try:
        parser.feed(document)
        parser.close()
    except Exception:  # noqa: BLE001 - a parser bug must not fail the document: the rest
        # of the document is kept as it is (an untranslatable token)
        parser.tokens.append(_Token("other", parser.tokens[-1].start + 1 if parser.tokens
                                    else 0))
    tokens = parser.tokens
    if not tokens or tokens[0].start != 0:
        tokens.insert(0, _Token("other", 0))
    for token, following in zip(tokens, tokens[1:]):
        token.end = following.start
    tokens[-1].end = len(document)
    return [token for token in tokens if token.end > token.start]


# -- blocks and rows -------------------------------------------------------------------------

@dataclass
class HtmlRow:
    """One row of an HTML document: its text, the source span it replaces and its markup."""

    text: str
    span: tuple[int, int]
    markup: RowMarkup


@dataclass
class _Item:
    """A block's content in order: a character of text (decoded, with its source span), or
    a piece of markup ("start", "end", "marker", "opaque") with its source span; an opaque
    element also carries its visible text as characters."""

    kind: str
    start: int
    end: int
    name: str = ""
    text: str = ""  # a text run's decoded text; an opaque element's visible text
    starts: list[int] = field(default_factory=list)  # a text run's characters' sources
    ends: list[int] = field(default_factory=list)
    raw: str = ""  # markup's source
    length: int = 0  # an opaque element's length in the block's (collapsed) text


Pieces = Callable[[str, int, int], list[tuple[int, int]]]


def html_rows(document: str, language: str | None, split_sentences: bool,
              pieces: Pieces, max_rows: int | None = None) -> list[HtmlRow]:
    """The rows of an HTML document, in order; `pieces(text, start, end)` cuts a sentence
    text[start:end] that is too long for the model into pieces (documents.plan_document).
    Past `max_rows` rows it stops early, returning the rows so far (more than max_rows)."""
    tokens = tokenize(document)
    rows: list[HtmlRow] = []
    block: list[_Item] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        name = token.name
        if token.kind == "text":
            decoded, starts, ends = _characters(document, token.start, token.end)
            block.append(_Item("text", token.start, token.end, text=decoded, starts=starts,
                               ends=ends))
        elif token.kind == "start" and (name in OPAQUE_BLOCKS or name in OPAQUE_INLINE
                                        or token.untranslatable) and name not in VOID_ELEMENTS:
            last = _matching_end(tokens, index)
            inline = name not in OPAQUE_BLOCKS and name not in BLOCK_ELEMENTS
            if inline:
                # its text: up to its end tag, or through its last token where HTML ends it
                closed = tokens[last].kind == "end" and tokens[last].name == name
                inner = tokens[index + 1:last if closed else last + 1]
                visible = "".join(_characters(document, t.start, t.end)[0]
                                  for t in inner if t.kind == "text")
                block.append(_Item("opaque", token.start, tokens[last].end, name, text=visible,
                                   raw=document[token.start:tokens[last].end]))
            else:
                rows += _block_rows(block, language, split_sentences, pieces)
                block = []
                if max_rows is not None and len(rows) > max_rows:
                    return rows
            index = last + 1
            continue
        elif name in BLOCK_ELEMENTS:
            rows += _block_rows(block, language, split_sentences, pieces)
            block = []
            if max_rows is not None and len(rows) > max_rows:
                return rows
        elif token.kind == "start" and name not in VOID_ELEMENTS:
            block.append(_Item("start", token.start, token.end, name,
                               raw=document[token.start:token.end]))
        elif token.kind == "end" and name not in VOID_ELEMENTS:
            block.append(_Item("end", token.start, token.end, name,
                               raw=document[token.start:token.end]))
        else:  # comment, declaration, void or self-closed tag: a marker where it is
            block.append(_Item("marker", token.start, token.end,
                               raw=document[token.start:token.end]))
        index += 1
    rows += _block_rows(block, language, split_sentences, pieces)
    return rows


def _matching_end(tokens: list[_Token], index: int) -> int:
    """The index of the last token of the element started at `index`: its end tag
    (counting nested elements of its name); else the token before the end tag of an element
    opened outside it (a parent's: HTML closes the element there), or, for an element whose
    end tag HTML lets out (p, li, td, ...), before the next start tag of its name (or, for
    p, of a block); the last token when none comes."""
    name = tokens[index].name
    depth = 0
    inner: dict[str, int] = {}  # elements opened inside and not yet closed, by name
    for at in range(index + 1, len(tokens)):
        token = tokens[at]
        if token.kind == "start" and token.name not in VOID_ELEMENTS:
            if name in _OPTIONAL_END and depth == 0 and (
                    token.name == name or name == "p" and token.name in BLOCK_ELEMENTS):
                return at - 1
            if token.name == name:
                depth += 1
            else:
                inner[token.name] = inner.get(token.name, 0) + 1
        elif token.kind == "end":
            if token.name == name:
                if depth == 0:
                    return at
                depth -= 1
            elif inner.get(token.name):
                inner[token.name] -= 1
            elif token.name not in VOID_ELEMENTS:
                return at - 1  # closes an element opened before this one
    return len(tokens) - 1


def _characters(document: str, start: int, end: int) -> tuple[str, list[int], list[int]]:
    """The decoded text of document[start:end], and each decoded character's source start
    and end (an entity's characters share the entity's span)."""
    if "&" not in document[start:end]:
        return document[start:end], list(range(start, end)), list(range(start + 1, end + 1))
    parts: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    position = start
    for match in _ENTITY.finditer(document, start, end):
        parts.append(document[position:match.start()])
        starts += range(position, match.start())
        ends += range(position + 1, match.start() + 1)
        decoded = html.unescape(match.group())
        parts.append(decoded)
        starts += [match.start()] * len(decoded)
        ends += [match.end()] * len(decoded)
        position = match.end()
    parts.append(document[position:end])
    starts += range(position, end)
    ends += range(position + 1, end + 1)
    return "".join(parts), starts, ends


def _block_rows(block: list[_Item], language: str | None, split_sentences: bool,
                pieces: Pieces) -> list[HtmlRow]:
    """The rows of one block: its whitespace-collapsed text split into sentences."""
    # the block's text as rendered: ASCII whitespace runs collapsed to one space; `sources`
    # holds each character's source span, `marks` each markup item's text position, and
    # `opaque` the text ranges of opaque elements (which no sentence boundary may cut)
    text: list[str] = []
    sources: list[tuple[int, int]] = []
    marks: list[tuple[int, _Item]] = []
    opaque: list[tuple[int, int]] = []
    for item in block:
        if item.kind == "text":
            for c, start, end in zip(item.text, item.starts, item.ends):
                _append(text, sources, c, start, end)
        elif item.kind == "opaque":
            begin = len(text)
            for c in item.text:
                _append(text, sources, c, item.start, item.end)
            item.length = len(text) - begin
            marks.append((begin, item))
            opaque.append((begin, len(text)))
        else:
            marks.append((len(text), item))
    content = "".join(text)
    if not content.strip():
        return []
    if split_sentences:
        spans = sentence_spans(content, 0, len(content), language)
    else:
        stripped = content.strip()
        first = content.index(stripped[0])
        spans = [(first, first + len(stripped))]
    spans = [piece for start, end in spans for piece in pieces(content, start, end)]
    spans = _keep_opaque_whole(spans, opaque)
    rows = []
    positions = [at for at, _ in marks]
    for start, end in spans:
        source_start, source_end = sources[start][0], sources[end - 1][1]
        # the markup at the sentence's text positions (one before its start: an opaque
        # element whose text starts with a space), inside its extent
        first = bisect.bisect_left(positions, start - 1)
        last = bisect.bisect_right(positions, end)
        inside = [(at, item) for at, item in marks[first:last]
                  if item.kind == "opaque" and item.length and at < end
                  and at + item.length > start
                  or start <= at <= end and source_start <= item.start
                  and item.end <= source_end]
        for _, item in inside:  # an opaque element at an edge: its tags join the extent
            source_start = min(source_start, item.start)
            source_end = max(source_end, item.end)
        row_text = content[start:end]
        rows.append(HtmlRow(row_text, (source_start, source_end),
                            RowMarkup(row_text, _tree(inside, start))))
    return rows


def _append(text: list[str], sources: list[tuple[int, int]], c: str, start: int,
            end: int) -> None:
    """One decoded character onto the block's text, ASCII whitespace collapsed."""
    if c in _ASCII_SPACE:
        if text and text[-1] == " ":
            return
        c = " "
    text.append(c)
    sources.append((start, end))


def _keep_opaque_whole(spans: list[tuple[int, int]],
                       opaque: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sentences merged where a boundary would cut an opaque element's text: where an
    element begun before the next sentence's start ends after the previous one's end.
    `opaque` is in text order; one pass over both."""
    merged: list[tuple[int, int]] = []
    index, furthest = 0, -1  # furthest end of the elements begun before the span's start
    for span in spans:
        while index < len(opaque) and opaque[index][0] < span[0]:
            if opaque[index][1] > opaque[index][0]:
                furthest = max(furthest, opaque[index][1])
            index += 1
        if merged and furthest > merged[-1][1]:
            merged[-1] = (merged[-1][0], span[1])
        else:
            merged.append(span)
    return merged


def _tree(marks: list[tuple[int, _Item]], offset: int) -> list[Node]:
    """The row's markup as a tree: start and end tags matched by name with a stack (an end
    tag closes the nearest open element of its name; elements it skips stay unmatched), the
    rest as markers; positions relative to the row (`offset` its start in the block)."""
    matched: dict[int, int] = {}  # index of a start item -> index of its end item
    stack: list[int] = []
    for index, (_, item) in enumerate(marks):
        if item.kind == "start":
            stack.append(index)
        elif item.kind == "end":
            for depth in range(len(stack) - 1, max(len(stack) - _STACK_SEARCH, 0) - 1, -1):
                if marks[stack[depth]][1].name == item.name:
                    matched[stack[depth]] = index
                    del stack[depth:]
                    break
    closing = set(matched.values())
    root: list[Node] = []
    parents: list[tuple[Node, int]] = []  # open elements and the index of their end item
    for index, (at, item) in enumerate(marks):
        while parents and parents[-1][1] < index:
            parents.pop()
        siblings = parents[-1][0].children if parents else root
        position = max(at - offset, 0)
        if index in matched:
            end_at, end_item = marks[matched[index]]
            node = Node("element", item.raw, end_item.raw, position, end_at - offset)
            siblings.append(node)
            parents.append((node, matched[index]))
        elif index in closing:
            continue
        elif item.kind == "opaque" and item.length:
            siblings.append(Node("opaque", item.raw, start=position,
                                 end=position + item.length))
        else:
            siblings.append(Node("marker", item.raw, start=position, end=position))
    return root
