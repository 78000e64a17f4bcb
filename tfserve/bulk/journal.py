"""The resume journal: what a job has durably written, beside its output.

`<output>.tfserve-job.json` holds the job's fingerprint (input, model, options) and, after each
committed chunk, the input position consumed, the output bytes written and the counts so far.
A chunk is committed in this order:

    1. its output lines are appended, flushed and fsynced (the output file);
    2. the state is written to a temporary file, fsynced, and os.replace'd over the journal
       (atomic on POSIX), then the directory is fsynced so that the rename survives a reboot.

A crash between 1 and 2 leaves output past the journal's offset: a resumed job truncates the
output to the recorded offset and re-reads the input from the recorded position, so no line
is lost or written twice. A journal whose fingerprint differs from the new job's is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOURNAL_SUFFIX = ".tfserve-job.json"
SAMPLE_BYTES = 1 << 20  # the input's first and last MiB are hashed into its fingerprint


class JournalMismatchError(ValueError):
    """The journal beside the output was written by a different job (input, model or
    options): continuing would mix two jobs' outputs in one file."""


@dataclass
class JobState:
    fingerprint: dict[str, Any]
    input_position: int = 0  # bytes (lines, jsonl) or rows (csv, parquet) consumed
    output_bytes: int = 0
    lines: int = 0
    counts: dict[str, float] = field(default_factory=dict)
    finished: bool = False


def input_fingerprint(path: str) -> dict[str, Any]:
    """Size, modification time and a hash of the first and last MiB: a changed, replaced or
    appended file is detected without reading it all."""
    stat = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        digest.update(stream.read(SAMPLE_BYTES))
        if stat.st_size > SAMPLE_BYTES:
            stream.seek(max(SAMPLE_BYTES, stat.st_size - SAMPLE_BYTES))
            digest.update(stream.read(SAMPLE_BYTES))
    return {"path": os.path.abspath(path), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "sample_sha256": digest.hexdigest()}


def job_fingerprint(args: Any, decoding: dict[str, Any], input_format: str,
                    output_format: str, model: dict[str, Any]) -> dict[str, Any]:
    """Everything that changes what a line's output is, for the journal: the input, the model
    (`model`: the engine's fingerprint) and the options of `tfserve translate`'s flags (`args`);
    batch sizes, buffers, threads and where the job runs (one machine, servers, Ray) do not."""
    return {
        "input": input_fingerprint(args.input) if args.input not in (None, "-") else "stdin",
        **model,
        "options": json.dumps({
            "decoding": decoding, "input_format": input_format,
            "output_format": output_format, "text_field": args.text_field,
            "output_field": args.output_field, "bad_lines": args.bad_lines,
            "skip_marker": args.skip_marker, "split_sentences": args.split_sentences,
            "format": getattr(args, "format", None)}, sort_keys=True, default=str)}


def _fsync_directory(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Journal:
    """The journal of the job writing `output`."""

    def __init__(self, output: str | Path) -> None:
        self.output = Path(output)
        self.path = self.output.with_name(self.output.name + JOURNAL_SUFFIX)

    def load(self) -> JobState | None:
        if not self.path.is_file():
            return None
        data = json.loads(self.path.read_text())
        return JobState(**data)

    def start(self, fingerprint: dict[str, Any]) -> JobState:
        """The state to continue from: the journal's (its fingerprint checked, the output cut
        back to what it recorded), or a fresh one (the output emptied)."""
        state = self.load()
        if state is None:
            state = JobState(fingerprint)
            with open(self.output, "wb") as stream:
                os.fsync(stream.fileno())
            self.commit(state)
            return state
        if state.fingerprint != fingerprint:
            changed = sorted(key for key in set(state.fingerprint) | set(fingerprint)
                             if state.fingerprint.get(key) != fingerprint.get(key))
            raise JournalMismatchError(
                f"{self.output} belongs to another job ({', '.join(changed)} changed since it "
                f"started; its journal is {self.path}): remove both to start again, or write "
                "to another --output")
        if not state.finished:
            # output past the last committed chunk is a chunk that was being written: cut it
            with open(self.output, "ab") as stream:
                stream.truncate(state.output_bytes)
                os.fsync(stream.fileno())
        return state

    def commit(self, state: JobState) -> None:
        """Replace the journal with `state`, atomically and durably."""
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "w") as stream:
            json.dump(asdict(state), stream, sort_keys=True)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, self.path)
        _fsync_directory(self.path.parent)
