"""The process's thread pool for GIL-releasing numpy work, shared by the searches' passes
over logits (`tfserve.generation.kernels`) and the host placement's cache copies
(`tfserve.runtime.cache`): one pool, so the two never oversubscribe the cores."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

_POOL: ThreadPoolExecutor | None = None


def numpy_pool() -> ThreadPoolExecutor:
    """The process's threads for GIL-releasing numpy work (search and host cache copies)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tfserve-numpy")
    return _POOL
