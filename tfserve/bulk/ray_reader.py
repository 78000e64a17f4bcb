"""The corpus as a Ray Dataset: tfserve's own readers (records.py) as a Ray datasource, or Ray
Data's readers.

Plain lines and JSON Lines going to one local file are read by `RecordsDatasource`, so that a
Ray job reads exactly what the one-machine job reads:

- lines split at "\\n" only (Ray's read_text splits with str.splitlines, which also cuts at
  form feeds, U+2028 and other boundaries, so its line count would differ);
- a line that is not UTF-8, or JSON that does not parse, is a bad line for --bad-lines, with
  its number (read_text and read_json fail the whole job at it);
- each file streamed in blocks of `block_lines` records, so a big file is never whole in one
  worker's memory and its blocks spread over the actors;
- each row keeps its line number, its byte end (the journal's input position) and, for JSON
  Lines, its record's fields, from which the writer (records.Writer) rebuilds the output line
  as the one-machine job writes it.

The other inputs (CSV, Parquet) and JSON Lines written into a directory or object store go
through Ray Data's readers (read_csv, read_parquet, read_json), whose columns are the records'
fields and which number nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tfserve.bulk.records import Record, read_json_lines, read_lines

# the columns RecordsDatasource adds to each row ("text" holds the text to translate); read by
# TranslateBatch and the ordered writer, never written
LINE_COLUMN = "__tfserve_line"  # the line's number in its file
READ_ERROR_COLUMN = "__tfserve_read_error"  # why the line has no text (not UTF-8, not JSON)
RAW_COLUMN = "__tfserve_raw"  # such a line as text (replacement characters where not UTF-8)
END_COLUMN = "__tfserve_end"  # the byte offset after the line in its file
FIELDS_COLUMN = "__tfserve_fields"  # a JSON Lines record's fields, as JSON
READER_COLUMNS = (LINE_COLUMN, READ_ERROR_COLUMN, RAW_COLUMN, END_COLUMN, FIELDS_COLUMN)

# Read tasks reserve no CPU: reading is light next to translating, and actors that reserve
# every CPU of the cluster (the usual sizing) would otherwise leave none to read with, and the
# job would wait forever. Ray Data's backpressure still bounds how far reads run ahead.
READ_ARGS: dict[str, Any] = {"num_cpus": 0}


def byte_lines(stream: Any, chunk: int = 1 << 20) -> Iterator[bytes]:
    """A binary stream's lines, each with its "\\n" (the last one may have none)."""
    rest = b""
    while True:
        data = stream.read(chunk)
        if not data:
            break
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


def optional_text(value: Any) -> str | None:
    """A string column's value, None where it is missing: a block whose values of a column are
    all None reaches a numpy batch as NaN floats (numpy's float32 too, which is no float)."""
    if value is None or (not isinstance(value, str) and value != value):  # NaN != NaN
        return None
    return str(value)


def row_record(row: dict[str, Any]) -> Record:
    """A RecordsDatasource row (after translation, any other columns ignored) as the Record
    the one-machine job read."""
    fields = optional_text(row.get(FIELDS_COLUMN))
    return Record(int(row[LINE_COLUMN]), optional_text(row["text"]), int(row[END_COLUMN]),
                  error=optional_text(row[READ_ERROR_COLUMN]),
                  raw=optional_text(row[RAW_COLUMN]) or "",
                  fields=json.loads(fields) if fields is not None else None)


def _records_datasource() -> type:
    """RecordsDatasource, made when Ray is imported (its base class is Ray's)."""
    import pyarrow as pa
    from ray.data.datasource import FileBasedDatasource

    class RecordsDatasource(FileBasedDatasource):
        """Plain lines (fmt "lines") or JSON Lines (fmt "jsonl", the text in `text_field`)
        read by records.py, from line skip_lines + 1 (module docstring)."""

        # one schema for every block, whether or not it holds a bad line
        block_schema = pa.schema([("text", pa.string()), (LINE_COLUMN, pa.int64()),
                                  (READ_ERROR_COLUMN, pa.string()), (RAW_COLUMN, pa.string()),
                                  (END_COLUMN, pa.int64()), (FIELDS_COLUMN, pa.string())])

        def __init__(self, paths: str | list[str], fmt: str, text_field: str,
                     block_lines: int, skip_lines: int = 0, **kwargs: Any) -> None:
            super().__init__(paths, **kwargs)
            self.fmt, self.text_field = fmt, text_field
            self.block_lines, self.skip_lines = block_lines, skip_lines

        def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
            records = (read_json_lines(byte_lines(f), self.text_field)  # type: ignore[arg-type]
                       if self.fmt == "jsonl" else read_lines(byte_lines(f)))  # type: ignore[arg-type]
            columns: dict[str, list[Any]] = {name: [] for name in self.block_schema.names}
            for record in records:
                if record.number <= self.skip_lines:  # written by the job being resumed
                    continue
                columns["text"].append(record.text)
                columns[LINE_COLUMN].append(record.number)
                columns[READ_ERROR_COLUMN].append(record.error)
                columns[RAW_COLUMN].append(record.raw or None)
                columns[END_COLUMN].append(record.end)
                columns[FIELDS_COLUMN].append(
                    None if record.fields is None
                    else json.dumps(record.fields, ensure_ascii=False, default=str))
                if len(columns["text"]) >= self.block_lines:
                    yield pa.table(columns, schema=self.block_schema)
                    columns = {name: [] for name in columns}
            if columns["text"]:
                yield pa.table(columns, schema=self.block_schema)

    return RecordsDatasource


def read_dataset(path: str, fmt: str, text_field: str = "text", ordered: bool = True,
                 blocks: int | None = None, block_lines: int = 4096,
                 skip_lines: int = 0) -> Any:
    """The corpus as a Ray Dataset. Plain lines, and JSON Lines when `ordered` (written to one
    local file), by RecordsDatasource in blocks of `block_lines` records from line
    skip_lines + 1, the text in a "text" column; the others by Ray Data's readers, cut into
    `blocks` blocks (default: Ray's choice), the text in `text_field`. Each block is one task
    for one actor, so a small file needs a few to keep several actors busy."""
    import ray.data

    if reads_records(fmt, ordered):
        return ray.data.read_datasource(
            _records_datasource()(path, fmt, text_field, block_lines, skip_lines),
            **READ_ARGS)
    args = {**READ_ARGS, "override_num_blocks": blocks}
    if fmt == "jsonl":
        return ray.data.read_json(path, lines=True, **args)
    if fmt == "csv":
        return ray.data.read_csv(path, **args)
    return ray.data.read_parquet(path, **args)


def reads_records(fmt: str, ordered: bool) -> bool:
    """Whether read_dataset reads `fmt` with RecordsDatasource (rows numbered, text in
    "text")."""
    return fmt == "lines" or (fmt == "jsonl" and ordered)
