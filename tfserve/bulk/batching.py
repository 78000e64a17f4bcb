"""Batches of a read buffer: sorted by length, cut by rows and by a padded-token budget.

CTranslate2's translate_file does the same (a read buffer of N lines sorted by length,
`max_batch_size` with `batch_type="tokens"`): sorting a buffer, not the whole file, keeps
memory bounded while rows of one batch still need little padding; the token budget keeps a
batch of long rows from costing what a batch of short ones does in rows.
"""

from __future__ import annotations

from collections.abc import Sequence


def token_batches(lengths: Sequence[int], max_batch_size: int,
                  max_batch_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, grouped into batches of rows of similar length.

    A batch holds at most max_batch_size rows and at most max_batch_tokens padded tokens
    (rows x its longest row); a row longer than the budget is a batch of its own. Batches
    come shortest first; within a batch, rows are in length order.
    """
    if max_batch_size < 1 or max_batch_tokens < 1:
        raise ValueError(f"max_batch_size and max_batch_tokens must be >= 1, got "
                         f"{max_batch_size} and {max_batch_tokens}")
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # sorted ascending: this row is the batch's longest, so the padded size is rows x it
        width = max(lengths[index], 1)
        if current and (len(current) + 1 > max_batch_size
                        or (len(current) + 1) * width > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches
