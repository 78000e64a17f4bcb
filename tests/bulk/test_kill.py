"""kill -9 in the middle of a file job, for real: the job runs as `python -m tfserve` in a
process of its own, is killed (SIGKILL) once its journal shows K committed chunks (the test
polls the journal, it never sleeps for a time), and the same command run again finishes the
file: the output equals an uninterrupted run's, no line lost or written twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import number_phrases
from server_helpers import ROOT

CHUNK = 3  # --read-buffer: lines per committed chunk
KILL_AFTER = 4  # chunks


def job(source: Path, out: Path, model: Path) -> list[str]:
    return [sys.executable, "-m", "tfserve", "translate", "--model", str(model), "--input",
            str(source), "--output", str(out), "--read-buffer", str(CHUNK), "--threads", "1",
            "--progress", "none"]


def committed_lines(journal: Path) -> int:
    """Lines the journal records (it is replaced atomically: always whole JSON, or absent)."""
    try:
        return int(json.loads(journal.read_text())["lines"])
    except FileNotFoundError:
        return 0


def kill_9_once_committed(process: subprocess.Popen[Any], journal: Path,
                          lines: int) -> dict[str, Any]:
    """SIGKILL `process` once `journal` records at least `lines` committed lines (its state,
    polled; the job must still be running then); the journal's state after the kill."""
    try:
        while committed_lines(journal) < lines:
            assert process.poll() is None, "the job ended before it could be killed"
            time.sleep(0.005)  # polling the journal's state, not waiting for a time
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    return json.loads(journal.read_text())


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path: Path,
                                                        demo_model: Path) -> None:
    source = tmp_path / "in.txt"
    lines = number_phrases(300, seed=7)
    source.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed_out = tmp_path / "killed.txt"
    journal = tmp_path / "killed.txt.tfserve-job.json"
    process = subprocess.Popen(job(source, killed_out, demo_model), cwd=ROOT, env=env)
    state = kill_9_once_committed(process, journal, KILL_AFTER * CHUNK)
    assert not state["finished"] and state["lines"] < len(lines), "killed too late to test"
    resumed = subprocess.run(job(source, killed_out, demo_model), cwd=ROOT, env=env,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    whole_out = tmp_path / "whole.txt"
    whole = subprocess.run(job(source, whole_out, demo_model), cwd=ROOT, env=env,
                           capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    assert killed_out.read_bytes() == whole_out.read_bytes()
    assert len(killed_out.read_text().splitlines()) == len(lines)
