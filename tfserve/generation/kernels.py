"""numpy passes over a step's logits [R,V] (log-softmax, top-k, filtering), the large ones split
by rows over the process's thread pool (`tfserve.step.threads.numpy_pool`, which the host
cache's copies share; numpy releases the GIL in them)."""

from __future__ import annotations

import os

import numpy as np

from tfserve.step.threads import numpy_pool

PARALLEL_MIN_ELEMENTS = 1 << 20  # below this, threads cost more than they save
SCORE_BLOCK_ELEMENTS = 1 << 18  # rows per score_rows block: ~1 MiB of float32 logits


def _threaded(logits: np.ndarray) -> bool:
    """Whether a pass over logits [R,V] is worth splitting by rows over threads."""
    return (os.cpu_count() or 1) >= 2 and logits.size >= PARALLEL_MIN_ELEMENTS and (
        logits.shape[0] >= 2)


def _row_chunks(logits: np.ndarray) -> list[np.ndarray]:
    if not _threaded(logits):
        return [logits]
    return np.array_split(logits, min(os.cpu_count() or 1, logits.shape[0]))


def _logsumexp_rows(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(axis=-1)  # [R]
    shifted = np.subtract(logits, peak[:, None])
    np.exp(shifted, out=shifted)
    return peak + np.log(shifted.sum(axis=-1))


def top_k_unordered(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k largest logits [R,k], in no particular order."""
    vocab = logits.shape[-1]
    if k >= vocab:
        return np.broadcast_to(np.arange(vocab), logits.shape)
    return np.argpartition(logits, vocab - k, axis=-1)[:, vocab - k :]


def score_rows(logits: np.ndarray, banned: int | np.ndarray | None, k: int
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """One pass over float32 logits [R,V] for a decoder step, edited in place.

    Returns each row's logsumexp [R], taken before the `banned` token or tokens [n] (if any)
    are set to -inf,
    and the indices of each row's k largest remaining logits [R,k] in no order (None for
    k = 0). Rows go to the thread pool in blocks of a few rows, so the top-k reads a block
    while it is still in cache from the logsumexp (numpy releases the GIL in both).
    """

    def block(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        lse = _logsumexp_rows(rows)
        if banned is not None:
            rows[:, banned] = -np.inf
        return lse, top_k_unordered(rows, k) if k else None

    if not _threaded(logits):
        return block(logits)
    step = max(1, SCORE_BLOCK_ELEMENTS // logits.shape[1])
    parts = list(numpy_pool().map(block, [logits[i: i + step]
                                          for i in range(0, logits.shape[0], step)]))
    lse = np.concatenate([part[0] for part in parts])
    return lse, np.concatenate([part[1] for part in parts]) if k else None  # type: ignore[misc]


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """Row-wise log(sum(exp(logits))) of float32 logits [R,V] -> [R].

    log-probabilities are logits - logsumexp[:, None]; searches form them only where needed
    (greedy: one entry per row), which saves several passes over [R, V] per step. Large
    inputs are split by rows over threads (numpy releases the GIL in exp and sum).
    """
    chunks = _row_chunks(logits)
    if len(chunks) == 1:
        return _logsumexp_rows(logits)
    return np.concatenate(list(numpy_pool().map(_logsumexp_rows, chunks)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of float32 logits [R,V]."""
    return logits - logsumexp(logits)[:, None]


def filter_logits(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Top-k then nucleus filtering of logits [R,V]; removed entries become -inf.

    Nucleus keeps the smallest set of most likely tokens whose probability reaches top_p
    (the most likely token is always kept).
    """
    logits = logits.copy()
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(logits, vocab - top_k, axis=-1)[:, vocab - top_k][:, None]  # [R,1]
        logits[logits < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-logits, axis=-1, kind="stable")  # [R,V] most likely first
        sorted_logits = np.take_along_axis(logits, order, axis=-1)
        probs = np.exp(log_softmax(sorted_logits))
        before = np.cumsum(probs, axis=-1) - probs  # probability mass ahead of each token
        remove_sorted = before >= top_p
        remove_sorted[:, 0] = False
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        logits[remove] = -np.inf
    return logits
