"""The pieces of a job without a model: batches, readers and writers, the journal, progress."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

from tfserve.bulk.batching import token_batches
from tfserve.bulk.journal import JobState, Journal, JournalMismatchError, input_fingerprint
from tfserve.bulk.progress import Counts, Progress
from tfserve.bulk.records import (
    Record,
    Writer,
    read_csv,
    read_json_lines,
    read_lines,
    read_parquet,
)

# -- batching --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_rows,max_tokens", [(1, 100), (4, 10**6), (64, 40), (8, 7)])
def test_token_batches_cover_every_row_once_within_limits(max_rows: int, max_tokens: int) -> None:
    rng = random.Random(max_rows)
    lengths = [rng.randrange(1, 30) for _ in range(200)]
    batches = token_batches(lengths, max_rows, max_tokens)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        widths = [lengths[i] for i in batch]
        assert widths == sorted(widths)
        assert len(batch) <= max_rows
        # a row over the budget is a batch of its own; otherwise rows x longest fits
        assert len(batch) == 1 or len(batch) * max(widths) <= max_tokens
    # length-sorted across batches too: little padding anywhere
    flat = [lengths[i] for batch in batches for i in batch]
    assert flat == sorted(flat)


def test_token_batches_refuse_empty_limits() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        token_batches([1], 0, 10)


# -- readers and writers -----------------------------------------------------------------------


def test_read_lines_positions_resume_where_they_say() -> None:
    data = b"one\r\ntwo\n\nbad \xff line\nlast"
    records = list(read_lines(io.BytesIO(data)))
    assert [r.text for r in records] == ["one", "two", "", None, "last"]
    assert [r.number for r in records] == [1, 2, 3, 4, 5]
    assert records[3].error.startswith("not valid UTF-8") and "\ufffd" in records[3].raw
    assert records[-1].end == len(data)
    # a reader started at a record's end position reads exactly the rest
    stream = io.BytesIO(data)
    stream.seek(records[1].end)
    rest = list(read_lines(stream, records[1].end, 3))
    assert [(r.number, r.text, r.end) for r in rest] == [
        (r.number, r.text, r.end) for r in records[2:]]


def test_read_json_lines_pass_fields_and_name_bad_ones() -> None:
    data = (b'{"id": 1, "text": "twelve"}\n{"id": 2, "text": 3}\n{not json\n\n'
            b'{"id": 4, "text": "seven"}\n')
    records = list(read_json_lines(io.BytesIO(data), "text"))
    assert [r.text for r in records] == ["twelve", None, None, "", "seven"]
    assert records[0].fields == {"id": 1, "text": "twelve"}
    assert "no string field 'text'" in records[1].error
    assert records[2].error.startswith("JSON that does not parse")
    writer = Writer("jsonl")
    assert json.loads(writer.line(records[0], "douze")) == {"id": 1, "text": "twelve",
                                                           "translation": "douze"}
    assert json.loads(writer.line(records[2], None, "bad")) == {
        "source": "{not json", "translation": None, "error": "bad"}


def test_writer_lines_keep_one_line_per_record() -> None:
    writer = Writer("lines", skip_marker="#")
    record = Record(1, "x", 2)
    assert writer.line(record, "a\nb") == b"a b\n"
    assert writer.line(record, None) == b"#\n"


def test_read_csv_and_parquet_resume_by_row(tmp_path: Path) -> None:
    rows = [{"id": str(i), "text": f"line {i}\nwith a newline" if i == 2 else f"line {i}"}
            for i in range(7)]
    csv_path = tmp_path / "in.csv"
    import csv

    with open(csv_path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, ["id", "text"])
        writer.writeheader()
        writer.writerows(rows)
    records = list(read_csv(str(csv_path), "text"))
    assert [r.text for r in records] == [row["text"] for row in rows]
    assert [r.text for r in read_csv(str(csv_path), "text", 4)] == [
        row["text"] for row in rows[4:]]
    with pytest.raises(ValueError, match="no column 'body'"):
        list(read_csv(str(csv_path), "body"))

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    parquet_path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet_path, row_group_size=3)
    records = list(read_parquet(str(parquet_path), "text", batch_rows=2))
    assert [r.text for r in records] == [row["text"] for row in rows]
    assert [r.end for r in records] == list(range(1, 8))
    assert [r.text for r in read_parquet(str(parquet_path), "text", 4)] == [
        row["text"] for row in rows[4:]]


# -- journal ----------------------------------------------------------------------------------


def test_journal_cuts_output_back_to_its_last_commit(tmp_path: Path) -> None:
    output = tmp_path / "out.txt"
    journal = Journal(output)
    state = journal.start({"input": "a"})
    output.write_bytes(b"committed\n")
    state.output_bytes, state.input_position, state.lines = 10, 5, 1
    journal.commit(state)
    with open(output, "ab") as stream:
        stream.write(b"half a chu")  # a chunk written, its commit never made
    resumed = Journal(output).start({"input": "a"})
    assert (resumed.output_bytes, resumed.input_position, resumed.lines) == (10, 5, 1)
    assert output.read_bytes() == b"committed\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_journal_refuses_another_job(tmp_path: Path) -> None:
    output = tmp_path / "out.txt"
    Journal(output).start({"input": "a", "model": "m", "options": "o"})
    with pytest.raises(JournalMismatchError, match="model changed"):
        Journal(output).start({"input": "a", "model": "other", "options": "o"})


def test_input_fingerprint_sees_a_changed_tail(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"x" * (3 << 20))
    before = input_fingerprint(str(path))
    with open(path, "r+b") as stream:  # same size, same first MiB, a changed last byte
        stream.seek(-1, 2)
        stream.write(b"y")
    after = input_fingerprint(str(path))
    assert before["sample_sha256"] != after["sample_sha256"]
    assert JobState(before).fingerprint != JobState(after).fingerprint


# -- progress ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_logs_every_interval_when_not_a_terminal() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, total=1000, tty=False, interval=30, clock=clock, label="job")
    clock.now += 10
    progress.update(100, Counts(lines=10, tokens=50))
    assert stream.getvalue() == ""  # not yet 30 s
    clock.now += 20
    progress.update(250, Counts(lines=25, tokens=150))
    assert stream.getvalue() == ("job: 25 lines, 150 tokens, 5 tokens/s, 25% of input, "
                                 "about 1m30s left\n")
    clock.now += 5
    line = progress.summary(Counts(lines=25, tokens=150, failures=1, skipped=2, truncated=3))
    assert line == "job: done: 25 lines, 150 tokens, 35.0 s, 1 failures, 2 skipped, 3 truncated"
    assert stream.getvalue().endswith(line + "\n")


def test_progress_bar_on_a_terminal() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, total=1000, tty=True, clock=clock, label="job")
    clock.now += 2
    progress.update(500, Counts(lines=7, tokens=40))
    progress.summary()
    text = stream.getvalue()
    assert "job" in text and "lines=7" in text and "tok_s=20" in text
