"""Documents through the Python API and the command line (issue 36):
Translator.translate_document and `tfserve translate --document FILE [--format html]`.

The model is the bundled demo (English number phrases into French): a document's answer
equals its sentences translated one by one (Translator.translate) joined with its layout
(greedy), and the CLI writes what translate_document gives, with and without a server.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
from server_helpers import ServerThread, server_args

from tfserve import cli
from tfserve.text.documents import DocumentLimits, plan_document

LAYOUT = "seven. eight.\n\n  twenty-one.\n- three hundred and forty-two.\n"
GREEDY = {"num_beams": 1, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def demo(demo_model: Path) -> Path:
    """The bundled demo, exported once a session (tests/conftest.py)."""
    return demo_model


@pytest.fixture(scope="module")
def translator(demo: Path) -> Any:
    from tfserve.translator import Translator

    return Translator(demo, intra_op_threads=1)


def test_translate_document_equals_its_sentences_one_by_one(translator: Any) -> None:
    plan = plan_document(LAYOUT)
    expected = plan.assemble(translator.translate(plan.rows, **GREEDY)).text
    document = translator.translate_document(LAYOUT, **GREEDY)
    assert document.text == expected == document.hypotheses[0].text
    assert [(s.source_start, s.source_end) for s in document.segments] == plan.source_spans
    assert document.detected_language is None and document.confidence is None
    # split_sentences=False: one sequence, as translate() gives
    whole = translator.translate_document(LAYOUT, split_sentences=False, **GREEDY)
    assert whole.text == translator.translate([LAYOUT], **GREEDY)[0]
    assert whole.segments == []


def test_translate_document_n_best_and_html(translator: Any) -> None:
    document = translator.translate_document("seven. twenty-one.", num_beams=3,
                                             num_return_sequences=2, max_new_tokens=24)
    assert len(document.hypotheses) == 2
    assert all(len(segment.hypotheses) == 2 for segment in document.segments)
    page = translator.translate_document("<p>seven. <i>eight</i>.</p>", format="html",
                                         **GREEDY)
    assert page.text.startswith("<p>sept") and "<i>" in page.text


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"format": "pdf"}, "format must be one of text, html"),
    ({"source_language": "auto"}, "source_language 'auto' needs a multilingual model"),
    ({"limits": DocumentLimits(max_characters=10)}, "over the limit of 10 characters"),
])
def test_translate_document_refusals_name_the_field(translator: Any, kwargs: dict[str, Any],
                                                     named: str) -> None:
    with pytest.raises(ValueError, match=named):
        translator.translate_document(LAYOUT, **kwargs)


def run_cli(monkeypatch: pytest.MonkeyPatch, argv: list[str], stdin: str = "") -> tuple[int,
                                                                                        str]:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code or 0, out.getvalue()


def test_cli_translates_a_document_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        demo: Path, translator: Any) -> None:
    path = tmp_path / "doc.txt"
    path.write_text(LAYOUT, encoding="utf-8")
    flags = ["--model", str(demo), "--threads", "1", "--beams", "1", "--max-new-tokens", "24"]
    code, out = run_cli(monkeypatch, ["translate", "--document", str(path), *flags])
    assert code == 0
    assert out == translator.translate_document(LAYOUT, **GREEDY).text
    page = tmp_path / "page.html"
    page.write_text("<p>seven. eight.</p>\n", encoding="utf-8")
    code, out = run_cli(monkeypatch, ["translate", "--document", str(page), "--format", "html",
                                      *flags])
    assert code == 0 and out.startswith("<p>sept") and out.endswith("</p>\n")
    # standard input, and through a server (which splits every text it is sent)
    code, piped = run_cli(monkeypatch, ["translate", "--document", "-", *flags], LAYOUT)
    assert (code, piped) == (0, translator.translate_document(LAYOUT, **GREEDY).text)
    with ServerThread(server_args(demo)) as server:
        code, served = run_cli(monkeypatch, ["translate", "--document", str(path), "--server",
                                             server.target, "--beams", "1",
                                             "--max-new-tokens", "24"])
    assert (code, served) == (0, piped)
    # positional texts work as before
    code, out = run_cli(monkeypatch, ["translate", "seven", *flags])
    assert (code, out) == (0, translator.translate(["seven"], **GREEDY)[0] + "\n")
