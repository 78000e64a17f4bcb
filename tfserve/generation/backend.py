"""What the search needs from a model: the Backend protocol and the output of one step (the
step contract, `tfserve.step`, which the runtime implements without importing generation),
and the tokens no search produces on a backend."""

from __future__ import annotations

import numpy as np

from tfserve.step import Backend, Cache, RowCutter, SampleDraws, StepOutput, narrow_first

__all__ = ["Backend", "Cache", "RowCutter", "SampleDraws", "StepOutput", "banned_tokens",
           "narrow_first"]


def banned_tokens(backend: Backend) -> np.ndarray | None:
    """The token ids [n] no search may produce on `backend`, None for none: its
    `banned_token_ids`, or, where it has none, the pad token unless it is also eos (the rule
    of tfserve.artifacts.generation_defaults.pad_ban, for a manifest written before the field)."""
    banned = getattr(backend, "banned_token_ids", None)
    if banned is None:
        pad = backend.pad_token_id
        banned = (pad,) if pad != backend.eos_token_id else ()
    return np.array(banned, np.int64) if len(banned) else None
