"""Progress while a job runs, and its summary line at the end.

On a terminal: a tqdm bar over the input's bytes (so it can tell the time left without
counting lines first), with lines and tokens per second beside it. Otherwise (a log file, a
pipe, a batch system): one line every `interval` seconds, by the injected clock. Both go to
standard error: standard output may be the translations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any


@dataclass
class Counts:
    lines: int = 0
    tokens: int = 0  # target tokens generated
    failures: int = 0  # calls that failed and were retried (another address, or row by row)
    skipped: int = 0
    truncated: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """update() after each committed chunk; summary() once at the end.

    total: the input's size in its position's unit (bytes, or rows where the reader counts
    rows), None when unknown (standard input). start: the position a resumed job starts at.
    """

    def __init__(self, stream: IO[str], *, total: int | None = None, start: int = 0,
                 tty: bool | None = None, interval: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, label: str = "translate",
                 enabled: bool = True) -> None:
        self.stream, self.total, self.start = stream, total, start
        self.interval, self.clock, self.label, self.enabled = interval, clock, label, enabled
        self.started = clock()
        self.last_log = self.started
        self.position = start
        self.counts = Counts()
        self.tty = stream.isatty() if tty is None else tty
        self._bar: Any = None
        if enabled and self.tty:
            try:
                from tqdm import tqdm
            except ImportError:  # no `files` extra: log lines on the terminal too
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, initial=start, unit="B", unit_scale=True,
                                 file=stream, desc=label, dynamic_ncols=True)

    def rate(self) -> float:
        """Target tokens per second since this run started."""
        elapsed = self.clock() - self.started
        return self.counts.tokens / elapsed if elapsed > 0 else 0.0

    def update(self, position: int, counts: Counts) -> None:
        self.counts = counts
        advanced, self.position = position - self.position, position
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(advanced)
            self._bar.set_postfix(lines=counts.lines, tok_s=f"{self.rate():.0f}", refresh=False)
            return
        now = self.clock()
        if now - self.last_log >= self.interval:
            self.last_log = now
            print(self.log_line(now), file=self.stream, flush=True)

    def log_line(self, now: float) -> str:
        elapsed = now - self.started
        line = (f"{self.label}: {self.counts.lines} lines, {self.counts.tokens} tokens, "
                f"{self.rate():.0f} tokens/s")
        done = self.position - self.start
        if self.total and done > 0:
            left = elapsed * (self.total - self.position) / done
            line += f", {100 * self.position / self.total:.0f}% of input, about " \
                    f"{_duration(left)} left"
        return line

    def summary(self, counts: Counts | None = None) -> str:
        """The job's summary line (printed unless disabled) and returned."""
        counts = counts or self.counts
        if self._bar is not None:
            self._bar.close()
        seconds = self.clock() - self.started
        line = (f"{self.label}: done: {counts.lines} lines, {counts.tokens} tokens, "
                f"{seconds:.1f} s, {counts.failures} failures, {counts.skipped} skipped, "
                f"{counts.truncated} truncated")
        if self.enabled:
            print(line, file=self.stream, flush=True)
        return line
