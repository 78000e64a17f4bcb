"""Bulk translation on a Ray cluster (the `ray` extra: `pip install 'tfserve[ray]'`).

`TranslateBatch` is the callable class for Ray Data's `map_batches`: each actor loads the
artifacts once, with ONNX Runtime's threads set to the CPUs Ray gave the actor, and translates
one column of each batch it is handed (length-sorted, token-budget batches inside it, as the
one-machine job does):

    import ray
    from tfserve.bulk.ray_job import TranslateBatch

    ds = ray.data.read_text("s3://bucket/corpus.txt", drop_empty_lines=False)
    ds = ds.map_batches(TranslateBatch, fn_constructor_kwargs={"model": "/models/opus-mt"},
                        batch_size=1024, concurrency=8, num_cpus=4)   # num_gpus=1: a GPU each
    ds.write_parquet("s3://bucket/translated/")

`run_ray_job` is `tfserve translate --ray ADDRESS --input ... --output ...`: the corpus read
as a Dataset (ray_reader.py: tfserve's own readers as a Ray datasource, or Ray Data's; local
paths and whatever filesystems Ray's pyarrow reads: s3://, gs://, ...), the class above on an
actor pool, and the output either streamed to one local file in input order (through this
process, written by the one-machine job's Writer, and from plain or JSON lines resumable with
the one-machine job's journal) or written by Ray's writers into a directory or object-store
prefix. Lost actors and nodes are Ray's to recover: the actors are
restarted (max_restarts) and their tasks retried (max_task_retries), and lost blocks are
rebuilt from their lineage, so every line comes out once.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import IO, Any

import numpy as np

from tfserve.bulk.engines import LocalEngine, manifest_digest
from tfserve.bulk.job import BadLineError, JobOptions, Summary, translate_records
from tfserve.bulk.journal import JobState, Journal, job_fingerprint
from tfserve.bulk.progress import Counts
from tfserve.bulk.ray_reader import (
    END_COLUMN,
    LINE_COLUMN,
    RAW_COLUMN,
    READ_ERROR_COLUMN,
    READER_COLUMNS,
    optional_text,
    read_dataset,
    reads_records,
    row_record,
)
from tfserve.bulk.records import Record, Writer, input_format, output_format

TOKENS_COLUMN = "__tfserve_tokens"  # per-row target tokens, for the summary; never written
ERROR_COLUMN = "error"

def _assigned_cpus() -> int:
    """The CPUs Ray reserved for this actor (its ONNX Runtime threads), 0 outside Ray."""
    try:
        import ray

        return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0)))
    except Exception:  # noqa: BLE001 - not in a Ray worker: ONNX Runtime's own default
        return 0


class TranslateBatch:
    """A Ray Data map_batches class: `column` translated into `output_column`, the other
    columns passed through; a skipped line (bad_lines "skip") gets None and its reason in an
    "error" column."""

    def __init__(self, model: str, column: str = "text", output_column: str = "translation",
                 device: str = "cpu", threads: int = 0, bad_lines: str = "fail",
                 max_batch_size: int = 64, max_batch_tokens: int = 6144,
                 decoding: dict[str, Any] | None = None, count_tokens: bool = False,
                 split_sentences: bool = False) -> None:
        from tfserve.translator import Translator

        threads = threads or _assigned_cpus()
        translator = Translator(model, device=device, intra_op_threads=threads,
                                max_batch_size=max_batch_size)
        self.engine = LocalEngine(translator, "", **(decoding or {}))
        self.options = JobOptions(
            max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
            bad_lines=bad_lines, split_sentences=split_sentences,
            document_options={"language": (decoding or {}).get("source_language"),
                              "format": "text"})
        self.column, self.output_column, self.count_tokens = column, output_column, count_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [optional_text(text) for text in batch[self.column]]
        if LINE_COLUMN in batch:  # RecordsDatasource: numbers, and why a line is bad
            records = [row_record({key: batch[key][index] for key in (
                "text", LINE_COLUMN, END_COLUMN, READ_ERROR_COLUMN, RAW_COLUMN)})
                for index in range(len(texts))]
        else:  # Ray's readers: a missing text is the record's fault, its number unknown
            records = [Record(0, text, 0, error=None if text is not None else
                              f"no text in column {self.column!r}") for text in texts]
        results, _ = translate_records(self.engine, records, self.options)
        out = dict(batch)  # the reader's columns too: the ordered writer reads them
        out[self.output_column] = np.array([t for t, _, _ in results], dtype=object)
        errors = [e for _, e, _ in results]
        if any(error is not None for error in errors):
            out[ERROR_COLUMN] = np.array(errors, dtype=object)
        if self.count_tokens:
            out[TOKENS_COLUMN] = np.array([n for _, _, n in results], dtype=np.int64)
        return out


def _is_uri(path: str) -> bool:
    return "://" in path


def run_ray_job(args: argparse.Namespace, decoding: dict[str, Any],
                stderr: IO[str]) -> Summary:
    """`tfserve translate --ray ADDRESS --input ... --output ...` (module docstring)."""
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise ValueError("--ray needs Ray Data: pip install 'tfserve[ray]'") from exc
    if not args.input or args.input == "-" or not args.output or args.output == "-":
        raise ValueError("--ray reads --input and writes --output: files, directories or "
                         "object-store URIs, not standard input or output")
    if args.server:
        raise ValueError("--ray runs the model on the cluster's actors: drop --server")
    from pathlib import Path

    model = args.model
    if model is None:
        from tfserve.demo import default_artifacts

        model = default_artifacts()
    started = time.monotonic()
    if not ray.is_initialized():
        ray.init(address=None if args.ray == "local" else args.ray,
                 include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # output rows in input order
    context.enable_progress_bars = args.progress != "none"
    # an actor's own exception (a BadLineError), not Ray Data's UserCodeException, whose cause
    # does not survive the trip to this process
    context.raise_original_map_exception = True
    fmt = input_format(args.input, args.input_format)
    to_directory = _is_uri(args.output) or args.output.endswith("/")
    out_format = output_format(args.output, args.output_format)
    counts = Counts()
    journal = state = None
    ordered = not to_directory  # one local file, in input order, through this process
    if ordered and reads_records(fmt, ordered) and not _is_uri(args.input) \
            and not _is_uri(str(model)):
        # resumable: the one-machine job's journal and fingerprint (either may continue the
        # other's file), the input position a byte offset, committed after each block
        journal = Journal(args.output)
        state = journal.start(job_fingerprint(args, decoding, fmt, out_format,
                                              {"model": manifest_digest(model)}))
        if state.finished:
            line = (f"translate --ray: {args.output} is already complete ({state.lines} "
                    f"lines; its journal is {journal.path}): nothing to do")
            if args.progress != "none":
                print(line, file=stderr, flush=True)
            return Summary(counts, line, already_finished=True)
        counts = Counts(**{key: int(value) for key, value in state.counts.items()})
        counts.lines = state.lines
    elif ordered:
        # rewritten whole: a journal beside it from an earlier job no longer holds
        Journal(args.output).path.unlink(missing_ok=True)
    dataset = read_dataset(args.input, fmt, args.text_field, ordered,
                           block_lines=args.read_buffer, skip_lines=state.lines if state else 0)
    # RecordsDatasource puts the text in "text"; Ray's readers leave it in its field
    field = "text" if reads_records(fmt, ordered) else args.text_field
    translated = dataset.map_batches(
        TranslateBatch, batch_size=args.read_buffer, batch_format="numpy",
        fn_constructor_kwargs={
            "model": str(Path(model).resolve()) if not _is_uri(str(model)) else str(model),
            "column": field, "output_column": args.output_field, "device": args.device,
            "threads": args.threads, "bad_lines": args.bad_lines,
            "max_batch_size": args.max_batch_size, "max_batch_tokens": args.max_batch_tokens,
            # tokens counted for the summary where the rows pass through this process
            "decoding": decoding, "count_tokens": not to_directory,
            "split_sentences": args.split_sentences},
        # Ray Data restarts a lost actor and retries its tasks (its actor pools' default
        # max_restarts and max_task_retries are -1): a killed node costs time, not lines
        concurrency=args.ray_actors, num_cpus=args.ray_cpus, num_gpus=args.ray_gpus)
    if to_directory and reads_records(fmt, ordered):
        translated = translated.drop_columns(list(READER_COLUMNS))  # never written
    bad = None
    try:
        _write(translated, args, out_format, to_directory, counts, journal, state)
    except Exception as exc:
        bad = _bad_line(exc)
        if bad is None:
            raise
    if bad is not None:
        # the line and its reason, not the actor's traceback: a new error, raised outside the
        # handler, so that no chain of Ray's errors keeps its failed iterator (and the
        # iterator's prefetching thread) alive
        raise BadLineError(bad.number, bad.reason)
    seconds = time.monotonic() - started
    if to_directory:  # skipped lines carry an "error" field in the written rows
        line = f"translate --ray: done: {counts.lines} lines, {seconds:.1f} s, in {args.output}"
    else:
        line = (f"translate --ray: done: {counts.lines} lines, {counts.tokens} tokens, "
                f"{seconds:.1f} s, {counts.failures} failures, {counts.skipped} skipped, "
                f"{counts.truncated} truncated")
    if args.progress != "none":
        print(line, file=stderr, flush=True)
    return Summary(counts, line)


def _write(translated: Any, args: argparse.Namespace, out_format: str, to_directory: bool,
           counts: Counts, journal: Journal | None, state: JobState | None) -> None:
    """Run the pipeline into --output."""
    import ray.data

    if to_directory:
        # the pipeline runs once, inside the write; the summary's lines are read back from
        # what was written (Parquet: its metadata), its tokens are not counted
        if out_format == "jsonl":
            translated.write_json(args.output)
            counts.lines = ray.data.read_json(args.output, lines=True).count()
        else:
            translated.write_parquet(args.output)
            counts.lines = ray.data.read_parquet(args.output).count()
        return
    write_ordered(translated, args.output, out_format, args.output_field, args.skip_marker,
                  counts, journal=journal, state=state)
    if journal is not None and state is not None:
        state.finished = True
        journal.commit(state)


def _bad_line(error: BaseException | None) -> BadLineError | None:
    """The BadLineError that failed an actor's task, from the error Ray raises here."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        # exactly a BadLineError: Ray's RayTaskError(BadLineError) is one too, but its message
        # is the actor's traceback; the plain one is its `cause`
        if type(error) is BadLineError:
            return error
        seen.add(id(error))
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__
    return None


def write_ordered(dataset: Any, output: str, fmt: str, output_field: str,
                  skip_marker: str, counts: Counts, on_batch: Any = None,
                  journal: Journal | None = None, state: JobState | None = None) -> None:
    """Stream the translated rows to one local file, in input order (preserve_order), one
    line per input line: what the one-machine job writes (RecordsDatasource's rows are
    written by its Writer). With a journal, the output continues at state.output_bytes and
    each block is committed once it is on disk."""
    writer = Writer(fmt, output_field, skip_marker=skip_marker)
    with open(output, "r+b" if state is not None else "wb") as stream:
        if state is not None:
            stream.seek(state.output_bytes)
        # batch_size None: each block as it arrives, so the file grows while the job runs
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            translations = batch[output_field]
            tokens = batch.get(TOKENS_COLUMN)
            errors = batch.get(ERROR_COLUMN)
            lines = []
            for index, translation in enumerate(translations):
                error = None if errors is None else errors[index]
                if translation is None:
                    counts.skipped += 1
                if LINE_COLUMN in batch:
                    record = row_record({key: value[index] for key, value in batch.items()})
                    lines.append(writer.line(record, translation, error))
                elif fmt == "lines":
                    lines.append(writer.line(Record(0, None, 0), translation, error))
                else:  # Ray's readers: the row's columns are the record's fields
                    fields = {key: _plain(value[index]) for key, value in batch.items()
                              if key not in (TOKENS_COLUMN, ERROR_COLUMN, output_field)}
                    lines.append(writer.line(Record(0, None, 0, fields=fields), translation,
                                             error))
            data = b"".join(lines)
            stream.write(data)
            counts.lines += len(translations)
            counts.tokens += int(tokens.sum()) if tokens is not None else 0
            if journal is not None and state is not None and len(translations):
                stream.flush()
                os.fsync(stream.fileno())  # the block is on disk before the journal says so
                state.input_position = int(batch[END_COLUMN][-1])
                state.output_bytes += len(data)
                state.lines, state.counts = counts.lines, counts.as_dict()
                journal.commit(state)
            if on_batch is not None:
                on_batch(counts)


def _plain(value: Any) -> Any:
    """A numpy scalar as the JSON value it holds."""
    return value.item() if isinstance(value, np.generic) else value
