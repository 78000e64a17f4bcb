"""Process-wide tuning of a serving process: glibc's handling of freed memory and the event
loop grpc.aio runs on (docs/server.md, Memory and --event-loop)."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
from collections.abc import Awaitable, Callable

# <malloc.h> mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
# glibc's arenas in a serving process: one (see keep_freed_memory)
MALLOC_ARENAS = 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (its mallopt and malloc_trim), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS)
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of handing it back to the kernel, in
    one arena.

    The decoding loop allocates cache-sized arrays (tens of MB) at every join and row
    reorder. By default glibc serves those with fresh mmap pages and returns them when freed,
    so every join paid the page faults again: a 32-row join of an opus-mt-base-sized model
    took 22 ms a wave instead of 8. Blocks up to 256 MiB now come from the heap and freed
    memory stays mapped (the RSS stays near its peak instead of falling back between waves).

    One arena (M_ARENA_MAX) rather than glibc's default of one per thread up to 8 per core:
    memory kept per thread is kept once for each thread that ever allocated a large block.
    gRPC's event_engine threads receive every request message (up to --max-message-bytes),
    and malloc_trim, which hands the memory of large requests back (trim_freed_memory),
    releases a thread arena's free pages but not the top of its heap: after refused 15 MB
    requests sent one after another, four such arenas kept 25-47 MiB each through a
    malloc_trim, while with one arena the RSS came back to within 2 MiB of idle
    (docs/server.md, Memory). One arena also has no 64 MiB heap limit, so the decoder's
    larger blocks are kept too. Threads then share its lock; small blocks come from each
    thread's own cache (tcache) without it, and ONNX Runtime's tensors from its own arena.

    Skipped when the operator set glibc's own MALLOC_* variables, or without glibc. Returns
    whether it was applied.
    """
    if any(name.startswith("MALLOC_") for name in os.environ):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS)
                and libc.mallopt(M_MMAP_THRESHOLD, 256 << 20)
                and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def trim_freed_memory() -> bool:
    """Hand the memory glibc keeps free back to the kernel (malloc_trim): the free pages of
    every arena and the top of the main heap. Returns whether anything was released (False
    without glibc).

    Called once the large requests in flight have all ended (tfserve.serving.calls): the
    memory a request of up to --max-message-bytes held (the received message, its parsed
    copy, its texts) would otherwise stay with the process under keep_freed_memory's policy.
    """
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


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
