"""Request inputs, checked and batched the same way by every front end and by the scheduler.

`check_texts` makes each bad input a ValueError naming the field and the limit (texts are
tokenized, within MAX_CHARS_PER_TOKEN characters per token, by tfserve.text.translation_inputs);
`length_groups` cuts inputs into encoder batches; `pool` and `encoder_hidden_states` turn
encoder output into sentence embeddings. Only numpy is imported:
the scheduler and the user-facing translator both build on this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tfserve.generation import Backend

POOLINGS = ("mean", "max", "first")
DEFAULT_MAX_TEXTS = 256
# longer than any tokenizer piece (SentencePiece's default limit is 16 characters)
MAX_CHARS_PER_TOKEN = 64


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """Sentence embeddings [B,D] from hidden states [B,S,D] over tokens where mask [B,S] is 1."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling == "first":
        return hidden[:, 0, :].astype(np.float32)
    weights = mask.astype(np.float32)[..., None]  # [B,S,1]
    if pooling == "mean":
        return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)
    return np.where(weights > 0, hidden, -np.inf).max(axis=1).astype(np.float32)


def encoder_hidden_states(backend: Backend, input_ids: np.ndarray,
                          attention_mask: np.ndarray) -> np.ndarray:
    """Hidden states [B,S,D] float32, without the cross K/V when the backend can skip them."""
    only_hidden = getattr(backend, "hidden_states", None)
    if only_hidden is not None:
        return only_hidden(input_ids, attention_mask)
    return np.asarray(backend.encode(input_ids, attention_mask)[0], dtype=np.float32)


ENCODER_CALL_TOKENS = 32  # one more encoder call costs about this many padded tokens


def length_groups(lengths: Sequence[int], max_rows: int, max_tokens: int,
                  call_tokens: int = ENCODER_CALL_TOKENS) -> list[list[int]]:
    """Indices of `lengths` split into encoder batches with the least padded work.

    Sorted by length, then cut (dynamic programming over the cut points) to minimise
    padded tokens (rows x longest) + call_tokens per batch, each batch within max_rows and
    max_tokens padded tokens. One batch of 32 number phrases of 8 to 50 tokens pads to
    1,600 tokens; cut in three it is about 1,000 (an opus-mt-base encoder: ~0.3 ms a token).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    count = len(order)
    best = [0.0] + [math.inf] * count  # best[j]: cost of grouping the j shortest
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        width = max(1, lengths[order[end - 1]])  # the longest of any group ending here
        for start in range(end - 1, max(-1, end - 1 - max_rows), -1):
            rows = end - start
            if rows > 1 and rows * width > max_tokens:
                break
            cost = best[start] + rows * width + call_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], count
    while end > 0:
        groups.append(order[cut[end]: end])
        end = cut[end]
    return groups[::-1]


def check_texts(texts: Any, max_texts: int = DEFAULT_MAX_TEXTS) -> list[str]:
    """The texts of a request as a list: at most `max_texts` strings, none of them blank."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ValueError("texts must be a list of strings")
    if not texts:
        raise ValueError("texts must not be empty")
    if len(texts) > max_texts:
        raise ValueError(f"texts holds {len(texts)} items, over the limit of {max_texts}")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{index}] must be a string, got {type(text).__name__}")
        if not text or text.isspace():  # not strip(): a copy of a text of up to 16 MB
            raise ValueError(f"texts[{index}] is empty")
    return list(texts)
