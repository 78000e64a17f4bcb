"""Process-wide tuning of a serving process: glibc's handling of freed memory and the event
loop grpc.aio runs on (docs/server.md, Memory and --event-loop)."""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import Awaitable, Callable


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of handing it back to the kernel.

    The decoding loop allocates cache-sized arrays (tens of MB) at every join and row
    reorder. By default glibc serves those with fresh mmap pages and returns them when freed,
    so every join paid the page faults again: a 32-row join of an opus-mt-base-sized model
    took 22 ms a wave instead of 8. Blocks up to the heap's limit now come from the heap and
    freed memory stays mapped (the RSS stays near its peak instead of falling back between
    waves). The limit: the main thread's heap has none, other threads' heaps (the decoder
    worker's, the copy pool's) grow to 64 MiB, so a single block above that (a cache tensor of
    a very large batch) is still mapped afresh. Skipped when the operator set glibc's own
    MALLOC_* variables, or without glibc. Returns whether it was applied.
    """
    if any(name.startswith("MALLOC_") for name in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(libc.mallopt(m_mmap_threshold, 256 << 20)
                and libc.mallopt(m_trim_threshold, 1 << 30))


def event_loop_runner(kind: str) -> Callable[[Awaitable[int]], int]:
    """asyncio.run, or uvloop's: "auto" takes uvloop when it is installed.

    grpc.aio spends most of its Python time in the event loop; on uvloop the demo served
    5.7% more at 32 clients and a lone request 0.4 ms sooner (docs/benchmarks.md).
    """
    if kind == "asyncio":
        return asyncio.run  # type: ignore[return-value]
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed "
                             "(pip install uvloop; it is not available on Windows)") from None
        return asyncio.run  # type: ignore[return-value]
    return uvloop.run  # type: ignore[no-any-return]
