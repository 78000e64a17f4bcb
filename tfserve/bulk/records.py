"""Readers and writers of a corpus: one record per input line (or row), in input order.

A reader yields `Record`s and knows its position after each one (a byte offset for line
files, a row number for CSV and Parquet), which is what the journal records and a resumed
reader starts from. Records carry their text, or the reason they have none (not UTF-8, JSON
that does not parse, no text field): the job's bad-line policy decides what that costs.

A writer turns one record and its translation into the bytes of one output line; the job
writes a whole buffer of them at once (journal.py makes that write durable).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

INPUT_FORMATS = ("lines", "jsonl", "csv", "parquet")
OUTPUT_FORMATS = ("lines", "jsonl")


@dataclass
class Record:
    """One input line: its 1-based number, its text (None when the line is bad, with the
    reason in `error`), the other fields of a JSON, CSV or Parquet record (passed through to
    a JSON Lines output), and the reader's position after it."""

    number: int
    text: str | None
    end: int
    error: str | None = None
    fields: dict[str, Any] | None = None
    raw: str = ""  # the undecodable line, with replacement characters (the truncate policy)


def input_format(path: str | None, given: str | None) -> str:
    """The format flag, else the file's extension (.jsonl/.json, .csv, .parquet), else lines."""
    if given:
        return given
    suffix = Path(path).suffix.lower() if path and path != "-" else ""
    return {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
            ".parquet": "parquet"}.get(suffix, "lines")


def output_format(path: str | None, given: str | None) -> str:
    if given:
        return given
    suffix = Path(path).suffix.lower() if path and path != "-" else ""
    return "jsonl" if suffix in (".jsonl", ".json", ".ndjson") else "lines"


def _strip_newline(raw: bytes) -> bytes:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
    return raw


def read_lines(stream: IO[bytes], start: int = 0, first_number: int = 1) -> Iterator[Record]:
    """Plain lines from a binary stream positioned at byte `start`."""
    position, number = start, first_number
    for raw in stream:
        position += len(raw)
        line = _strip_newline(raw)
        try:
            yield Record(number, line.decode("utf-8"), position)
        except UnicodeDecodeError as exc:
            yield Record(number, None, position, error=f"not valid UTF-8 ({exc.reason} at "
                         f"byte {exc.start})", raw=line.decode("utf-8", "replace"))
        number += 1


def read_json_lines(stream: IO[bytes], text_field: str, start: int = 0,
                    first_number: int = 1) -> Iterator[Record]:
    """JSON objects, one per line: `text_field` is translated, the other fields pass through."""
    for record in read_lines(stream, start, first_number):
        if record.text is None:
            yield record
            continue
        line = record.text
        if not line.strip():  # a blank line stays a blank line
            yield record
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Record(record.number, None, record.end, error=f"JSON that does not parse "
                         f"({exc.msg} at column {exc.colno})", raw=line)
            continue
        text = value.get(text_field) if isinstance(value, dict) else None
        if not isinstance(text, str):
            yield Record(record.number, None, record.end, error=f"no string field "
                         f"{text_field!r}", raw=line, fields=value if isinstance(value, dict)
                         else None)
            continue
        yield Record(record.number, text, record.end, fields=value)


def read_csv(path: str, text_field: str, start_row: int = 0) -> Iterator[Record]:
    """CSV with a header row (the standard library's reader: quoted fields may hold newlines,
    so the position is a row number, and a resumed reader skips that many rows)."""
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as stream:
        reader = csv.DictReader(stream)
        if reader.fieldnames is None or text_field not in reader.fieldnames:
            raise ValueError(f"{path}: the CSV header has no column {text_field!r} "
                             f"(columns: {reader.fieldnames}; --text-field names it)")
        for row_number, row in enumerate(reader):
            if row_number < start_row:
                continue
            text = row[text_field] or ""
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # surrogate-escaped bytes: not valid UTF-8
                yield Record(row_number + 1, None, row_number + 1, error="not valid UTF-8",
                             raw=text.encode("utf-8", "surrogateescape").decode(
                                 "utf-8", "replace"), fields=dict(row))
                continue
            yield Record(row_number + 1, text, row_number + 1, fields=dict(row))


def read_parquet(path: str, text_field: str, start_row: int = 0,
                 batch_rows: int = 4096) -> Iterator[Record]:
    """Parquet through pyarrow (the `files` extra), in record batches: memory holds one batch,
    not the file. Whole row groups before `start_row` are skipped without being read."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # the extra is not installed
        raise ValueError("reading Parquet needs pyarrow: pip install 'tfserve[files]'") from exc
    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: "
                         f"{parquet.schema_arrow.names}; --text-field names it)")
    groups, row, first_row = [], 0, 0  # first_row: the row the first kept group starts at
    for index in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(index).num_rows
        if row + rows > start_row:
            groups.append(index)
        else:
            first_row += rows
        row += rows
    row = first_row
    for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=groups):
        for values in batch.to_pylist():
            row += 1
            if row <= start_row:
                continue
            text = values.get(text_field)
            if text is not None and not isinstance(text, str):
                yield Record(row, None, row, error=f"{text_field!r} is not a string",
                             fields=values)
                continue
            yield Record(row, text or "", row, fields=values)


@dataclass
class Writer:
    """One output line per record: the translation (lines), or the record's fields with the
    translation added (jsonl). A skipped record gets `skip_marker` (lines) or its reason in
    an "error" field (jsonl)."""

    format: str = "lines"
    output_field: str = "translation"
    source_field: str = "source"  # jsonl output of plain-line input: the source text's field
    skip_marker: str = ""
    _buffer: list[str] = field(default_factory=list)

    def line(self, record: Record, translation: str | None, error: str | None = None) -> bytes:
        if self.format == "lines":
            text = self.skip_marker if translation is None else translation
            # a translation never spans lines: the output keeps one line per input line
            return (text.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8")
        if record.fields is not None:
            out = dict(record.fields)
        else:
            out = {self.source_field: record.text if record.text is not None else record.raw}
        out[self.output_field] = translation
        if error is not None:
            out["error"] = error
        return (json.dumps(out, ensure_ascii=False, default=str) + "\n").encode("utf-8")


def open_input(path: str | None) -> IO[bytes]:
    """The binary input stream: a file, or standard input for None / '-'."""
    import sys

    if path is None or path == "-":
        return sys.stdin.buffer if sys.stdin is not None else io.BytesIO()
    return open(path, "rb")
