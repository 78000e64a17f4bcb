"""The scheduler's batching limits (`SchedulerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Batching limits. See docs/server.md for the matching server flags."""

    max_batch_size: int = 32  # rows in the running decoder batch; inputs per encoder run
    max_batch_tokens: int = 8192  # padded source tokens per encoder run
    max_wait_ms: float = 2.0  # how long arrivals wait for company (BatchingPolicy.gather_deadline)
    max_queue: int = 256  # requests with inputs not yet taken up by the model
    # how many decoder steps arrivals may wait for the rows that just finished to come back
    # (closed-loop clients); 0: never wait for them
    wave_wait_steps: int = 4
    # while the idle worker waits for company, encode what has arrived (the wait then
    # overlaps encoder work); the rows join the decoder batch together when the wait ends.
    # Off by default: on 2 shared cores the encoder runs slowed the event loop receiving the
    # rest of the wave as much as they saved (docs/benchmarks.md, "Server settings compared")
    encode_ahead: bool = False

    def validate(self) -> SchedulerConfig:
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
