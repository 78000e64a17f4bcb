"""`tfserve translate --input FILE --output FILE` on the demo model, in process (cli.main):
output in input order equal to the Translator's, formats, bad lines, finishing and refusing."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import LONG_LINE, number_phrases

from tfserve import cli
from tfserve.argparsing import EXIT_USAGE
from tfserve.bulk import engines

SMALL = ["--threads", "1", "--progress", "log", "--progress-interval", "1e9"]


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """cli.main(["translate", *argv]): (exit code, standard error)."""
    capsys.readouterr()
    code = cli.main(["translate", *argv])
    return code, capsys.readouterr().err


def expected(translator: Any, lines: list[str]) -> list[str]:
    """What each line should become: the Translator's translation, blank for blank."""
    keep = [line for line in lines if line.strip()]
    translated = iter(translator.translate(keep))
    return [next(translated) if line.strip() else "" for line in lines]


def test_file_job_writes_every_line_in_input_order(
        tmp_path: Path, corpus: Path, demo_model: Path, demo_translator: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.txt"
    # small buffers and budgets: many chunks and batches, each sorted by length
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(corpus),
                                 "--output", str(out), "--read-buffer", "7",
                                 "--max-batch-tokens", "40", *SMALL])
    assert code == 0, err
    lines = corpus.read_text().splitlines()
    assert out.read_text().splitlines() == expected(demo_translator, lines)
    assert f"done: {len(lines)} lines," in err and "0 skipped, 0 truncated" in err


def test_file_job_equals_the_in_memory_path(
        tmp_path: Path, corpus: Path, demo_model: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(corpus.read_text()))
    capsys.readouterr()
    assert cli.main(["translate", "--model", str(demo_model), "--threads", "1"]) == 0
    in_memory = capsys.readouterr().out
    out = tmp_path / "out.txt"
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(corpus),
                                 "--output", str(out), "--read-buffer", "16", *SMALL])
    assert code == 0, err
    assert out.read_text() == in_memory


def test_standard_input_to_standard_output(
        corpus: Path, demo_model: Path, demo_translator: Any,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(corpus.read_bytes())))
    monkeypatch.setattr(sys, "stdout", stdout)
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", "-", "--output", "-",
                                 "--read-buffer", "5", *SMALL])
    assert code == 0, err
    lines = corpus.read_text().splitlines()
    assert stdout.buffer.getvalue().decode().splitlines() == expected(demo_translator, lines)


def test_json_lines_pass_their_other_fields(tmp_path: Path, demo_model: Path,
                                            demo_translator: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    texts = number_phrases(12, seed=3, blanks=False)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "body": text, "meta": {"k": i}}) + "\n"
                              for i, text in enumerate(texts)))
    out = tmp_path / "out.jsonl"
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(source),
                                 "--output", str(out), "--text-field", "body",
                                 "--output-field", "fr", "--read-buffer", "5", *SMALL])
    assert code == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == [{"id": i, "body": text, "meta": {"k": i}, "fr": fr}
                       for i, (text, fr) in enumerate(zip(texts, expected(demo_translator,
                                                                          texts)))]


def test_parquet_input(tmp_path: Path, demo_model: Path, demo_translator: Any,
                       capsys: pytest.CaptureFixture[str]) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = number_phrases(10, seed=4)
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": t, "n": i} for i, t in enumerate(texts)]),
                   source, row_group_size=4)
    out = tmp_path / "out.txt"
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(source),
                                 "--output", str(out), "--read-buffer", "3", *SMALL])
    assert code == 0, err
    assert out.read_text().splitlines() == expected(demo_translator, texts)


# -- bad lines --------------------------------------------------------------------------------


@pytest.fixture
def bad_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    """Good lines around a long one (line 3) and one that is not UTF-8 (line 5)."""
    good = number_phrases(6, seed=5, blanks=False)
    path = tmp_path / "bad.txt"
    path.write_bytes(b"\n".join([good[0].encode(), good[1].encode(), LONG_LINE.encode(),
                                 good[2].encode(), b"caf\xe9 " + good[3].encode(),
                                 good[4].encode()]) + b"\n")
    return path, good


def test_bad_lines_fail_by_default_naming_the_line(
        tmp_path: Path, bad_corpus: tuple[Path, list[str]], demo_model: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(bad_corpus[0]),
                                 "--output", str(tmp_path / "out.txt"), *SMALL])
    assert code == EXIT_USAGE
    assert "line 3:" in err and "over the limit of 64 source tokens" in err


def test_bad_lines_skipped_with_a_marker(
        tmp_path: Path, bad_corpus: tuple[Path, list[str]], demo_model: Path,
        demo_translator: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path, good = bad_corpus
    out = tmp_path / "out.txt"
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(path),
                                 "--output", str(out), "--bad-lines", "skip",
                                 "--skip-marker", "#SKIPPED", *SMALL])
    assert code == 0, err
    fine = expected(demo_translator, [good[0], good[1], good[2], good[4]])
    assert out.read_text().splitlines() == [fine[0], fine[1], "#SKIPPED", fine[2], "#SKIPPED",
                                            fine[3]]
    assert "done: 6 lines," in err and "2 skipped, 0 truncated" in err


def test_bad_lines_truncated(tmp_path: Path, bad_corpus: tuple[Path, list[str]],
                             demo_model: Path, demo_translator: Any,
                             capsys: pytest.CaptureFixture[str]) -> None:
    path, good = bad_corpus
    out = tmp_path / "out.txt"
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(path),
                                 "--output", str(out), "--bad-lines", "truncate", *SMALL])
    assert code == 0, err
    got = out.read_text().splitlines()
    assert len(got) == 6
    assert got[2] == demo_translator.translate([LONG_LINE], truncate=True)[0]
    assert got[4] == demo_translator.translate(["caf\ufffd " + good[3]])[0]
    assert "0 skipped, 2 truncated" in err


def test_json_that_does_not_parse_is_skipped_in_a_jsonl_output(
        tmp_path: Path, demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "twelve"}\n{"text": \n{"text": "seven"}\n')
    out = tmp_path / "out.jsonl"
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(source),
                                 "--output", str(out), "--bad-lines", "skip", *SMALL])
    assert code == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["translation"] for r in records] == ["douze", None, "sept"]
    assert records[1]["error"].startswith("line 2: JSON that does not parse")


# -- finishing, refusing, resuming ---------------------------------------------------------------


def test_a_finished_job_does_nothing_and_a_changed_one_is_refused(
        tmp_path: Path, corpus: Path, demo_model: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.txt"
    argv = ["--model", str(demo_model), "--input", str(corpus), "--output", str(out), *SMALL]
    assert run_cli(capsys, argv)[0] == 0
    first = out.read_bytes()
    code, err = run_cli(capsys, argv)
    assert code == 0 and "is already complete" in err
    assert out.read_bytes() == first
    code, err = run_cli(capsys, [*argv, "--max-new-tokens", "3"])  # other options
    assert code == EXIT_USAGE and "options changed" in err
    corpus.write_text(corpus.read_text() + "seven\n")  # another input
    code, err = run_cli(capsys, argv)
    assert code == EXIT_USAGE and "input changed" in err
    assert out.read_bytes() == first


def test_an_interrupted_job_resumes_without_losing_or_repeating_a_line(
        tmp_path: Path, corpus: Path, demo_model: Path, demo_translator: Any,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out.txt"
    argv = ["--model", str(demo_model), "--input", str(corpus), "--output", str(out),
            "--read-buffer", "6", "--max-batch-size", "4", *SMALL]
    translate, calls = engines.LocalEngine.translate, []

    def interrupted(self: Any, texts: Any, truncate: bool) -> Any:
        calls.append(len(texts))
        if len(calls) == 5:  # Ctrl-C in the middle of the job
            raise KeyboardInterrupt
        return translate(self, texts, truncate)

    monkeypatch.setattr(engines.LocalEngine, "translate", interrupted)
    assert run_cli(capsys, argv)[0] == 130
    journal = json.loads((tmp_path / "out.txt.tfserve-job.json").read_text())
    assert 0 < journal["lines"] < 60 and not journal["finished"]
    with open(out, "ab") as stream:  # a chunk half written when the machine went down
        stream.write(b"half a chunk\n")
    monkeypatch.setattr(engines.LocalEngine, "translate", translate)
    code, err = run_cli(capsys, argv)
    assert code == 0, err
    lines = corpus.read_text().splitlines()
    assert out.read_text().splitlines() == expected(demo_translator, lines)
    assert "done: 60 lines," in err


def test_split_sentences_translates_each_sentence_of_a_line(
        tmp_path: Path, demo_model: Path, demo_translator: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.text.documents import plan_document

    lines = ["twelve. Seven. Three hundred.", "", "forty-two",
             LONG_LINE.replace(" seven ", ". Seven ", 3)]  # sentences over the limit too
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    code, err = run_cli(capsys, ["--model", str(demo_model), "--input", str(source),
                                 "--output", str(out), "--split-sentences", *SMALL])
    assert code == 0, err
    want = []
    for line in lines:  # each line planned as the job plans it, its rows translated alone
        plan = plan_document(line, format="text", split_sentences=True,
                             max_tokens=demo_translator.max_source_tokens,
                             count_tokens=lambda text: len(
                                 demo_translator.tokenizer.encode_text(text)) + 1)
        rows = demo_translator.translate(plan.rows) if plan.rows else []
        want.append(plan.assemble(rows).text if line.strip() else "")
    assert len(plan_document(lines[0], format="text").rows) == 3
    assert out.read_text().splitlines() == want
    assert "0 skipped, 0 truncated" in err  # the long line was cut into pieces that fit
