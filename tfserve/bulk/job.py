"""The job loop: read a buffer, batch it, translate, write it in input order, record it.

    for each read buffer of N records (one chunk of the journal):
        each record -> its rows (one text, or a document's sentences with --split-sentences)
        rows sorted by length and cut into batches (batching.token_batches)
        batches submitted to the engine's worker threads
        the oldest pending buffer, once translated, is written and committed (journal.py)

Two buffers are pending at most, so memory holds about 2 x N records whatever the file's size,
while the engine always has the next buffer's batches to work on (reading and tokenizing
overlap decoding; a server's in-flight calls never drain at a buffer's end).

Bad lines (not UTF-8, JSON that does not parse, over the model's source limit) follow
`bad_lines`: "fail" stops the job naming the line, "skip" writes the writer's marker, and
"truncate" cuts an over-long line (and translates an undecodable one with replacement
characters; a JSON line that does not parse cannot be repaired and is skipped). A batch
refused for its input is retried row by row, so one bad line never costs its batch.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

from tfserve.bulk.batching import token_batches
from tfserve.bulk.engines import Engine, is_bad_input
from tfserve.bulk.journal import JobState, Journal
from tfserve.bulk.progress import Counts, Progress
from tfserve.bulk.records import Record, Writer

BAD_LINE_POLICIES = ("fail", "skip", "truncate")
PENDING_BUFFERS = 2


def where(number: int) -> str:
    """A record's place in its input; number 0: a row whose line number its reader does not
    know (Ray's JSON, CSV and Parquet readers)."""
    return f"line {number}" if number else "a row"


class BadLineError(ValueError):
    """A bad line under the "fail" policy: the job stops at it, naming it."""

    def __init__(self, number: int, reason: str) -> None:
        super().__init__(f"{where(number)}: {reason} (--bad-lines skip or truncate goes on "
                         "past such lines)")
        self.number, self.reason = number, reason

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return BadLineError, (self.number, self.reason)  # rebuilt where a Ray task failed


@dataclass
class JobOptions:
    max_batch_size: int = 64  # rows per batch
    max_batch_tokens: int = 6144  # padded source tokens per batch (rows x longest row)
    read_buffer: int = 4096  # records read, sorted and committed together
    bad_lines: str = "fail"
    split_sentences: bool = False
    # plan_document's format ("text", "html") and language, with split_sentences
    document_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bad_lines not in BAD_LINE_POLICIES:
            raise ValueError(f"--bad-lines must be one of {BAD_LINE_POLICIES}, got "
                             f"{self.bad_lines!r}")
        if min(self.max_batch_size, self.max_batch_tokens, self.read_buffer) < 1:
            raise ValueError("--max-batch-size, --max-batch-tokens and --read-buffer must be "
                             ">= 1")


@dataclass
class Summary:
    counts: Counts
    line: str
    already_finished: bool = False


@dataclass
class _Row:
    """One text sent to the model: its outcome once translated."""

    text: str
    length: int
    truncate: bool = False
    translation: str | None = None
    tokens: int = 0
    error: str | None = None
    truncated: bool = False


@dataclass
class _Item:
    """One record of a buffer and what it became."""

    record: Record
    rows: list[_Row] = field(default_factory=list)
    assemble: Callable[[list[str]], str] | None = None
    error: str | None = None  # the record is bad before any row is sent
    truncated: bool = False


@dataclass
class _Chunk:
    items: list[_Item]
    end: int  # the reader's position after the buffer's last record
    futures: list[Future[int]]

    def done(self) -> bool:
        return all(future.done() for future in self.futures)


def buffers(records: Iterable[Record], size: int) -> Iterator[list[Record]]:
    buffer: list[Record] = []
    for record in records:
        buffer.append(record)
        if len(buffer) >= size:
            yield buffer
            buffer = []
    if buffer:
        yield buffer


class _Loop:
    def __init__(self, engine: Engine, options: JobOptions) -> None:
        self.engine, self.options = engine, options
        self.max_rows = min(options.max_batch_size, engine.max_batch_size)
        self.split_failures = 0
        self._plan: Any = None
        if options.split_sentences:
            try:
                from tfserve.text.documents import plan_document
            except ImportError as exc:
                raise ValueError("--split-sentences needs tfserve.text.documents, which this "
                                 "install does not have yet") from exc
            self._plan = plan_document
            # a server's engine counts nothing: plan_document then counts UTF-8 bytes
            self._count_tokens = (engine.count_tokens if engine.count_tokens("x") is not None
                                  else None)

    def prepare(self, record: Record) -> _Item:
        """A record's rows, or why it has none (a bad line's policy applied here where it can
        be: the fail policy raises at write time, in input order)."""
        item = _Item(record)
        text = record.text
        if text is None:
            if self.options.bad_lines == "truncate" and record.error and \
                    record.error.startswith("not valid UTF-8"):
                text, item.truncated = record.raw, True  # replacement characters
            else:
                item.error = record.error or "no text"
                return item
        if not text.strip():
            return item  # a blank line gives a blank line, and the model never sees it
        if self._plan is not None:
            # the line as a document: one row per sentence, a sentence over the model's limit
            # cut into pieces that fit, the translations joined back with the line's spacing
            try:
                plan = self._plan(text, split_sentences=True,
                                  max_tokens=self.engine.max_source_tokens,
                                  count_tokens=self._count_tokens,
                                  **self.options.document_options)
            except ValueError as exc:  # over the document limits
                item.error = str(exc)
                return item
            texts = list(plan.rows)
            item.assemble = lambda translations, plan=plan: plan.assemble(translations).text
        else:
            texts = [text]
        for row_text in texts:
            if not row_text.strip():
                item.rows.append(_Row(row_text, 0, translation=""))
                continue
            length, over = self.engine.length(row_text)
            row = _Row(row_text, length)
            if over is not None:
                if self.options.bad_lines != "truncate":
                    item.error = over
                    item.rows = []
                    return item
                row.truncate = row.truncated = True
            item.rows.append(row)
        return item

    def run_batch(self, rows: list[_Row]) -> int:
        """Translate a batch (a worker thread); a batch refused for its input is retried row
        by row, so that only the bad row carries the error. Returns target tokens."""
        try:
            results = self.engine.translate([row.text for row in rows],
                                            any(row.truncate for row in rows))
        except Exception as exc:
            if not is_bad_input(exc):
                raise
            if len(rows) > 1:
                self.split_failures += 1
                return sum(self.run_batch([row]) for row in rows)
            row = rows[0]
            if self.options.bad_lines == "truncate" and not row.truncate:
                row.truncate = row.truncated = True  # a server's limit: cut it there
                return self.run_batch(rows)
            row.error = str(exc).replace("texts[0] ", "", 1)
            return 0
        for row, (translation, tokens) in zip(rows, results):
            row.translation, row.tokens = translation, tokens
        return sum(tokens for _, tokens in results)


def run_job(records: Iterable[Record], writer: Writer, sink: IO[bytes], engine: Engine,
            options: JobOptions, progress: Progress, journal: Journal | None = None,
            state: JobState | None = None) -> Summary:
    """Translate `records` into `sink` (positioned where `state` says output ends), committing
    each buffer to `journal` when there is one. Returns the counts and the summary line."""
    state = state or JobState({})
    counts = Counts(**{key: int(value) for key, value in state.counts.items()})
    counts.lines = state.lines
    if state.finished:
        line = progress.summary(counts)
        return Summary(counts, line, already_finished=True)
    loop = _Loop(engine, options)
    pending: deque[_Chunk] = deque()

    def write(chunk: _Chunk) -> None:
        for future in chunk.futures:
            counts.tokens += future.result()  # re-raises a worker's failure
        lines = []
        for item in chunk.items:
            lines.append(_output(item, writer, options, counts))
        data = b"".join(lines)
        sink.write(data)
        sink.flush()
        if journal is not None:
            os.fsync(sink.fileno())  # the chunk is on disk before the journal says so
        counts.lines += len(chunk.items)
        counts.failures = engine.failovers + loop.split_failures
        state.input_position, state.output_bytes = chunk.end, state.output_bytes + len(data)
        state.lines, state.counts = counts.lines, counts.as_dict()
        if journal is not None:
            journal.commit(state)
        progress.update(chunk.end, counts)

    with ThreadPoolExecutor(max_workers=engine.concurrency,
                            thread_name_prefix="tfserve-bulk") as executor:
        try:
            for buffer in buffers(records, options.read_buffer):
                items = [loop.prepare(record) for record in buffer]
                rows = [row for item in items for row in item.rows if row.translation is None]
                batches = token_batches([row.length for row in rows], loop.max_rows,
                                        options.max_batch_tokens if engine.exact_lengths
                                        else 1 << 62)
                futures = [executor.submit(loop.run_batch, [rows[i] for i in batch])
                           for batch in batches]
                pending.append(_Chunk(items, buffer[-1].end, futures))
                while pending and (len(pending) >= PENDING_BUFFERS or pending[0].done()):
                    write(pending.popleft())
            while pending:
                write(pending.popleft())
        except BaseException:
            for chunk in pending:  # stop promptly: queued batches are not started
                for future in chunk.futures:
                    future.cancel()
            raise
    state.finished = True
    if journal is not None:
        journal.commit(state)
    return Summary(counts, progress.summary(counts))


def _outcome(item: _Item, options: JobOptions, counts: Counts) -> tuple[str | None, str | None]:
    """(translation, None), or (None, why) for a skipped record: its bad-line policy applied
    and counted."""
    record = item.record
    error = item.error or next((row.error for row in item.rows if row.error), None)
    if error is not None:
        if options.bad_lines == "fail":
            raise BadLineError(record.number, error)
        counts.skipped += 1
        return None, f"{where(record.number)}: {error}"
    if item.truncated or any(row.truncated for row in item.rows):
        counts.truncated += 1
    translations = [row.translation or "" for row in item.rows]
    if item.assemble is not None:
        return item.assemble(translations), None
    return (translations[0] if translations else ""), None


def _output(item: _Item, writer: Writer, options: JobOptions, counts: Counts) -> bytes:
    """The output line of one record."""
    translation, error = _outcome(item, options, counts)
    return writer.line(item.record, translation, error)


def translate_records(engine: Engine, records: Sequence[Record], options: JobOptions
                      ) -> tuple[list[tuple[str | None, str | None, int]], Counts]:
    """Records translated in this thread (Ray's map_batches: the batch is the buffer):
    (translation, error, target tokens) per record, and the counts."""
    loop = _Loop(engine, options)
    items = [loop.prepare(record) for record in records]
    rows = [row for item in items for row in item.rows if row.translation is None]
    counts = Counts()
    for batch in token_batches([row.length for row in rows], loop.max_rows,
                               options.max_batch_tokens):
        counts.tokens += loop.run_batch([rows[i] for i in batch])
    results = []
    for item in items:
        translation, error = _outcome(item, options, counts)
        results.append((translation, error, sum(row.tokens for row in item.rows)))
    counts.lines, counts.failures = len(items), loop.split_failures
    return results, counts
