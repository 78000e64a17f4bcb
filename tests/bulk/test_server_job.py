"""A file job through running servers (`--server`, one address or several): chunks of the
server's advertised max_texts_per_request, a failed call retried on another address, and a
refused batch retried row by row so that one bad line costs only itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LONG_LINE, number_phrases
from server_helpers import ServerThread, free_port, server_args
from test_file_job import SMALL, expected, run_cli

MAX_TEXTS = 8  # the server's max_texts_per_request: far fewer than a read buffer


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[ServerThread]:
    with ServerThread(server_args(demo_model, "--max-texts-per-request",
                                  str(MAX_TEXTS))) as running:
        yield running


def test_server_job_chunks_by_the_servers_limit(tmp_path: Path, server: ServerThread,
                                                demo_translator: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    lines = number_phrases(70, seed=8)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    code, err = run_cli(capsys, ["--server", server.target, "--input", str(source),
                                 "--output", str(out), "--read-buffer", "50",
                                 "--in-flight", "3", *SMALL])
    assert code == 0, err
    assert out.read_text().splitlines() == expected(demo_translator, lines)
    assert "0 failures" in err


def test_a_dead_address_is_failed_over(tmp_path: Path, server: ServerThread,
                                       demo_translator: Any,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    lines = number_phrases(20, seed=9)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    code, err = run_cli(capsys, ["--server", f"{dead},{server.target}", "--input",
                                 str(source), "--output", str(out), "--in-flight", "2", *SMALL])
    assert code == 0, err
    assert out.read_text().splitlines() == expected(demo_translator, lines)
    failures = int(err.split(" failures")[0].rsplit(" ", 1)[1])
    assert failures >= 1  # the calls sent to the dead address first


def test_one_bad_line_costs_only_itself(tmp_path: Path, server: ServerThread,
                                        demo_translator: Any,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    good = number_phrases(7, seed=10, blanks=False)
    lines = [*good[:3], LONG_LINE, *good[3:]]  # one batch of 8: the server refuses it whole
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    code, err = run_cli(capsys, ["--server", server.target, "--input", str(source),
                                 "--output", str(out), "--bad-lines", "skip", *SMALL])
    assert code == 0, err
    fine = expected(demo_translator, good)
    assert out.read_text().splitlines() == [*fine[:3], "", *fine[3:]]
    assert "1 skipped" in err
    code, err = run_cli(capsys, ["--server", server.target, "--input", str(source),
                                 "--output", str(tmp_path / "cut.txt"), "--bad-lines",
                                 "truncate", *SMALL])
    assert code == 0, err
    got = (tmp_path / "cut.txt").read_text().splitlines()
    assert got[3] == demo_translator.translate([LONG_LINE], truncate=True)[0]
    assert "1 truncated" in err
    code, err = run_cli(capsys, ["--server", server.target, "--input", str(source),
                                 "--output", str(tmp_path / "fail.txt"), *SMALL])
    assert code == 2 and "line 4:" in err


@pytest.mark.parametrize(("beams", "batch", "note"), [
    ("4", "16", "the server decodes 32 rows at once (8 lines at 4 beams), fewer than a batch of "
                "16 lines: its --max-batch-size 64 decodes a whole batch at once"),
    ("2", "16", None),  # 32 rows hold 16 lines at 2 beams
])
def test_a_server_batch_smaller_than_the_jobs_is_named(
        tmp_path: Path, server: ServerThread, capsys: pytest.CaptureFixture[str],
        beams: str, batch: str, note: str | None) -> None:
    source = tmp_path / "in.txt"
    source.write_text("\n".join(number_phrases(4, seed=12, blanks=False)) + "\n")
    code, err = run_cli(capsys, ["--server", server.target, "--input", str(source), "--output",
                                 str(tmp_path / "out.txt"), "--beams", beams,
                                 "--max-batch-size", batch, *SMALL])
    assert code == 0, err
    notes = [line for line in err.splitlines() if "the server decodes" in line]
    assert [line.split(" translate: ", 1)[1] for line in notes] == ([note] if note else [])
