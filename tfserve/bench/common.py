"""What the benchmark tools share: the timed cases, timing, percentiles, CPU and RSS readers,
a server's /metrics read and its stop, the quiet export they time, and JSON lines with
rounded floats.

Imports the standard library and numpy only (the load generator runs without torch).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    """`sentences` inputs decoded in batches of `batch` with `beams` beams (1: greedy)."""

    batch: int
    beams: int
    sentences: int


# the offline benchmark times one batch of each (batch, beams); compare decodes `sentences`
CASES = {
    "greedy-b1": Case(batch=1, beams=1, sentences=8),
    "greedy-b16": Case(batch=16, beams=1, sentences=16),
    "beam4-b32": Case(batch=32, beams=4, sentences=32),
}


def timed_runs(fn: Callable[[], T], repeat: int) -> tuple[list[float], T]:
    """Wall times of `repeat` runs of `fn` after one warm-up run, and the warm-up's result."""
    result = fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times, result


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    """The q-th percentile of durations given in seconds, in ms to 2 decimals (NaN if none)."""
    if not len(seconds):
        return float("nan")
    return round(float(np.percentile(np.array(seconds) * 1000.0, q)), 2)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread of it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds so far of another process and its live children (a server
    with --workers: the parent and its workers), Linux /proc; None if unknown."""
    fields = _proc_stat(pid)
    if fields is None:
        return None
    children = [child for entry in os.listdir("/proc") if entry.isdigit()
                and (child := _proc_stat(entry)) is not None and child[1] == str(pid)]  # ppid
    ticks = sum(int(stat[11]) + int(stat[12]) for stat in [fields, *children])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_count() -> int:
    """The cores this process may use (as tfserve.runtime.default_threads, without importing
    onnxruntime into every child)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def proc_status_kib(pid: int, key: str) -> int:
    """A VmRSS / VmHWM line of /proc/PID/status, in KiB (Linux; KeyError without it)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def stop_process(process: subprocess.Popen) -> None:
    """Terminate a server the benchmark started, killed if it is not gone within 60 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def scraped_value(http_port: int, series: str) -> float | None:
    """The value of `series` (a name with its labels, if any) in GET /metrics of the server
    on this host's `http_port`; None where the server has no such series."""
    url = f"http://127.0.0.1:{http_port}/metrics"
    with urllib.request.urlopen(url, timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[1])
    return None


def export_quietly(source: Sequence[str], out: Path, *extra: str) -> int:
    """`python -m export SOURCE --out OUT EXTRA` in this process: overwriting, quiet, without
    the parity check (the benchmarks time graphs the export's own tests check); its exit code."""
    from export.cli import main as export_main

    return export_main([*source, "--out", str(out), "--force", "--quiet", "--parity-samples",
                        "0", *extra])


def json_line(row: dict[str, Any], digits: int) -> str:
    """`row` as one JSON line, floats rounded to `digits` decimals (for the console)."""
    return json.dumps({k: round(v, digits) if isinstance(v, float) else v for k, v in row.items()})
