"""`tfserve translate --input FILE --output FILE` (and `--ray ADDRESS`): the corpus flags and
the job they describe.

tfserve/cli.py declares the flags through `add_arguments` and hands a parsed command to `run`
when --input, --output or --ray is given; without them `translate` keeps its in-memory path.
This module is imported only then (lazily), so nothing in the serving path imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import IO, Any

from tfserve.bulk.engines import LocalEngine, ServerEngine, manifest_digest
from tfserve.bulk.job import BAD_LINE_POLICIES, JobOptions, Summary, run_job
from tfserve.bulk.journal import Journal, job_fingerprint
from tfserve.bulk.progress import Progress
from tfserve.bulk.records import (
    INPUT_FORMATS,
    OUTPUT_FORMATS,
    Writer,
    input_format,
    open_input,
    output_format,
    read_csv,
    read_json_lines,
    read_lines,
    read_parquet,
)

# the flags that make `translate` a corpus job (the others only tune one)
JOB_FLAGS = ("input", "output", "ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The corpus flags of `translate` (docs/bulk.md)."""
    group = parser.add_argument_group(
        "corpus", "a file job: streamed in read buffers, written in input order, resumable "
        "(docs/bulk.md)")
    group.add_argument("--input", default=None, metavar="FILE",
                       help="the corpus to translate, one record per line or row ('-': "
                       "standard input, the default when --output is given)")
    group.add_argument("--output", default=None, metavar="FILE",
                       help="where the translations go, one line per input record; a "
                       "journal beside it (FILE.tfserve-job.json) lets the same command "
                       "resume after an interruption ('-': standard output, no resume)")
    group.add_argument("--input-format", choices=INPUT_FORMATS, default=None,
                       help="default: from --input's extension (.jsonl, .csv, .parquet), "
                       "else lines")
    group.add_argument("--output-format", choices=OUTPUT_FORMATS, default=None,
                       help="default: from --output's extension (.jsonl), else lines")
    group.add_argument("--text-field", default="text", metavar="NAME",
                       help="the field (JSON Lines) or column (CSV, Parquet) to translate; "
                       "the others pass through to a JSON Lines output (default: text)")
    group.add_argument("--output-field", default="translation", metavar="NAME",
                       help="the JSON Lines output's field for the translation")
    group.add_argument("--bad-lines", choices=BAD_LINE_POLICIES, default="fail",
                       help="a line over the length limit, not UTF-8, or not JSON: stop at "
                       "it naming it (fail, the default), write --skip-marker instead "
                       "(skip), or cut it to the limit (truncate)")
    group.add_argument("--skip-marker", default="", metavar="TEXT",
                       help="the output line of a skipped line (default: an empty line; "
                       "JSON Lines output gets an \"error\" field)")
    group.add_argument("--max-batch-size", type=int, default=64, metavar="N",
                       help="rows per batch (default 64; with --server, at most the "
                       "server's max_texts_per_request)")
    group.add_argument("--max-batch-tokens", type=int, default=6144, metavar="N",
                       help="padded source tokens per batch, rows x longest row (default "
                       "6144)")
    group.add_argument("--read-buffer", type=int, default=4096, metavar="N",
                       help="records read and sorted by length together, and committed to "
                       "the journal together (default 4096)")
    group.add_argument("--in-flight", type=int, default=0, metavar="N",
                       help="with --server: calls in flight at once (default 4 per address)")
    group.add_argument("--progress", choices=("auto", "bar", "log", "none"), default="auto",
                       help="on standard error: a bar on a terminal, a log line every "
                       "--progress-interval seconds otherwise")
    group.add_argument("--progress-interval", type=float, default=30.0, metavar="SECONDS",
                       help="seconds between two progress log lines")
    group.add_argument("--split-sentences", action="store_true",
                       help="split each line into sentences, translate them and join them "
                       "back (for lines that hold paragraphs; off: a corpus line is "
                       "usually one sentence already)")
    ray = parser.add_argument_group("ray", "the job on a Ray cluster (tfserve[ray])")
    ray.add_argument("--ray", default=None, metavar="ADDRESS",
                     help="run on this Ray cluster ('auto': the one this machine belongs "
                     "to, 'local': a new one here); --input and --output may be local "
                     "paths or object-store URIs (s3://, gs://)")
    ray.add_argument("--ray-actors", type=int, default=2, metavar="N",
                     help="translating actors (default 2)")
    ray.add_argument("--ray-cpus", type=float, default=1.0, metavar="N",
                     help="CPUs per actor: its ONNX Runtime threads (default 1)")
    ray.add_argument("--ray-gpus", type=float, default=0.0, metavar="N",
                     help="GPUs per actor (default 0; 1: a GPU of its own per actor)")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the command is a corpus job."""
    return any(getattr(args, name, None) for name in JOB_FLAGS)


def _records(fmt: str, path: str | None, text_field: str, position: int,
             lines_done: int) -> tuple[Any, IO[bytes] | None]:
    """The reader from `position` on, and the stream to close after it."""
    if fmt in ("csv", "parquet"):
        if path is None or path == "-":
            raise ValueError(f"--input-format {fmt} reads a file: give --input FILE")
        reader = read_csv if fmt == "csv" else read_parquet
        return reader(path, text_field, position), None
    stream = open_input(path)
    if position:
        stream.seek(position)
    if fmt == "jsonl":
        return read_json_lines(stream, text_field, position, lines_done + 1), stream
    return read_lines(stream, position, lines_done + 1), stream


def _total(fmt: str, path: str | None) -> int | None:
    """The input's size in the reader's position unit, where it is cheap to know."""
    if path is None or path == "-":
        return None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    if fmt == "csv":
        return None
    return os.path.getsize(path)


def _engine(args: argparse.Namespace, decoding: dict[str, Any]) -> Any:
    if args.server:
        addresses = [address for address in args.server.split(",") if address]
        return ServerEngine(addresses, model=args.model_name, in_flight=args.in_flight,
                            **decoding)
    from tfserve.translator import Translator

    if args.model is None:
        from tfserve.demo import default_artifacts

        args.model = default_artifacts()
    translator = Translator(args.model, device=args.device, intra_op_threads=args.threads,
                            max_batch_size=args.max_batch_size)
    return LocalEngine(translator, manifest_digest(args.model), **decoding)


def run(args: argparse.Namespace, decoding: dict[str, Any], prog: str = "tfserve",
        stderr: IO[str] | None = None) -> Summary:
    """The job the flags describe; its summary (printed on standard error unless --progress
    none)."""
    if getattr(args, "json", False) or getattr(args, "scores", False) or getattr(
            args, "texts", None) or (decoding.get("num_return_sequences") or 1) > 1:
        raise ValueError("--input/--output translate a corpus: one translation per line, "
                         "without texts as arguments, --json, --scores or n-best "
                         "(--output-format jsonl keeps the records' fields)")
    if getattr(args, "document", None) is not None:
        raise ValueError("--document translates one file as one document; --input/--output "
                         "a corpus line by line (--split-sentences: each line a document)")
    if getattr(args, "truncate", False) and args.bad_lines == "fail":
        args.bad_lines = "truncate"  # translate's --truncate: cut long lines, as without a file
    if getattr(args, "eager", False):
        raise ValueError("--input/--output run the exported model (--model) or --server, "
                         "not --eager")
    if args.ray:
        from tfserve.bulk.ray_job import run_ray_job

        return run_ray_job(args, decoding, stderr=stderr or sys.stderr)
    stderr = stderr or sys.stderr
    in_format = input_format(args.input, args.input_format)
    out_format = output_format(args.output, args.output_format)
    options = JobOptions(max_batch_size=args.max_batch_size,
                         max_batch_tokens=args.max_batch_tokens, read_buffer=args.read_buffer,
                         bad_lines=args.bad_lines, split_sentences=args.split_sentences,
                         # the sentence splitter's rules: the texts' language, where given
                         document_options={"language": decoding.get("source_language"),
                                           "format": getattr(args, "format", None) or "text"})
    writer = Writer(out_format, args.output_field, skip_marker=args.skip_marker)
    to_file = args.output is not None and args.output != "-"
    from_file = args.input is not None and args.input != "-"
    if to_file and from_file and Path(args.input).resolve() == Path(args.output).resolve():
        raise ValueError("--output is --input: write the translations to another file")
    engine = _engine(args, decoding)
    try:
        note = engine.batch_note(options.max_batch_size) if args.server else None
        if note is not None and args.progress != "none":
            print(f"{prog} translate: {note}", file=stderr)
        journal = state = None
        if to_file:
            if not from_file:
                print(f"{prog} translate: reading standard input: the job cannot resume "
                      "(its input cannot be read again)", file=stderr)
            fingerprint = job_fingerprint(args, decoding, in_format, out_format,
                                          engine.fingerprint())
            journal = Journal(args.output)
            if not from_file:
                Path(journal.path).unlink(missing_ok=True)
            state = journal.start(fingerprint)
            if state.finished:
                print(f"{prog} translate: {args.output} is already complete ({state.lines} "
                      f"lines; its journal is {journal.path}): nothing to do", file=stderr)
        position = state.input_position if state else 0
        records, stream = _records(in_format, args.input, args.text_field, position,
                                   state.lines if state else 0)
        mode = args.progress
        progress = Progress(stderr, total=_total(in_format, args.input), start=position,
                            tty=None if mode == "auto" else mode == "bar",
                            interval=args.progress_interval, enabled=mode != "none",
                            label=f"{prog} translate")
        sink: IO[bytes]
        sink = open(args.output, "r+b") if to_file else sys.stdout.buffer
        try:
            if to_file:
                sink.seek(state.output_bytes if state else 0)
            summary = run_job(_skip_finished(records, state), writer, sink, engine, options,
                              progress, journal, state)
        finally:
            if to_file:
                sink.close()
            if stream is not None and from_file:  # standard input stays open
                stream.close()
        return summary
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _skip_finished(records: Any, state: Any) -> Any:
    """Nothing to read for a finished job (its summary is all it prints)."""
    if state is not None and state.finished:
        return iter(())
    return records


__all__ = ["add_arguments", "run", "wanted"]
