"""The scheduler's batching settings (`SchedulerConfig`), each declared once.

A field's default is the setting's default everywhere; its metadata holds the help text and
the range of the server's flag, from which tfserve.serving.settings builds `--name-with-dashes` and
the TFSERVE_NAME env var (see docs/server.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _setting(default: Any, help: str, limits: tuple[float, float] | None = None) -> Any:
    """A batching setting: a dataclass field with `help` and `limits` (the server flag's
    range, inclusive) in its metadata."""
    return field(default=default, metadata={"help": help, "limits": limits})


@dataclass
class SchedulerConfig:
    """Batching limits."""

    max_batch_size: int = _setting(
        32, "rows (beams and samples count one each) in the running decoder batch; inputs per "
        "encoder run", (1, 4096))
    max_batch_tokens: int = _setting(8192, "padded source tokens per encoder run", (1, 1 << 24))
    # the wait for company: BatchingPolicy.gather_deadline
    max_wait_ms: float = _setting(
        2.0, "how long queued inputs are gathered before joining a running batch; the least "
        "arrivals wait for the rows that just finished", (0, 10_000))
    max_queue: int = _setting(
        256, "requests that may wait for the model; more get RESOURCE_EXHAUSTED", (1, 1_000_000))
    wave_wait_steps: int = _setting(
        4, "decoder steps arrivals may wait for the rows that just finished to come back "
        "(closed-loop clients finishing together rejoin as one batch); 0: never wait for them "
        "(open-loop traffic)", (0, 10_000))
    # Off by default: on 2 shared cores the encoder runs slowed the event loop receiving the
    # rest of the wave as much as they saved (docs/benchmarks.md, "Server settings compared")
    encode_ahead: bool = _setting(
        False, "while the idle worker waits for returning rows, encode them as they arrive "
        "(true/false; helps where the event loop has a core of its own, costs a little where "
        "the server and its event loop share few cores)")

    def validate(self) -> SchedulerConfig:
        """The scheduler's own checks, for a config built in Python: whole counts at or above
        their least value and a finite wait (the server's flags are checked against their
        ranges before)."""
        for name in ("max_batch_size", "max_batch_tokens", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        value = self.wave_wait_steps
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"wave_wait_steps must be an integer >= 0, got {value!r}")
        if not 0 <= self.max_wait_ms <= 10_000:  # a finite wait: inf would hold arrivals
            raise ValueError(f"max_wait_ms must be in [0, 10000], got {self.max_wait_ms!r}")
        return self
