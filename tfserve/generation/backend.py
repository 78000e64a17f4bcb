"""What the search needs from a model: the Backend protocol and the output of one step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

Cache = Any  # a backend's per-layer tensors; the search code never looks inside


class StepOutput(NamedTuple):
    """One decoder call, as the search sees it."""

    logits: np.ndarray | None  # float32 [B,T,V]; None where the step was asked for none
    present: Cache
    # where the backend computes them (graph revision 2): each position's best
    # log-probabilities [B,T,K], best first, and their token ids [B,T,K]
    top_log_probs: np.ndarray | None = None
    top_ids: np.ndarray | None = None


class Backend(Protocol):
    """What the search needs from a model: an encoder, one decoder step, cache row ops."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    # optional, not declared here: `banned_token_ids`, the tokens no search produces on it
    # (the checkpoint's bans, model.json's); without it pad is banned unless it is eos
    # (`banned_tokens`)
    # step accepts cross K/V and encoder mask with B/G rows, row r using row r // G
    grouped_cross: bool
    decoder_start_token_id: int
    max_target_positions: int
    # K: the best candidates per position that every step gives (top_log_probs, top_ids),
    # 0 where it gives none. A backend with K > 0 takes need_logits=False in `step`
    # (optional: a backend without top candidates is never asked)
    top_candidates: int
    # optional, not declared here: `reorders_in_step`, True where `step` takes cache_rows
    # [B] (row i continues row cache_rows[i] of `past`) and reorders the cache inside the
    # step's run; the batch then leaves a beam step's reorder to the next step

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[Any, Cache]:
        """input_ids/attention_mask int64 [B,S] -> (hidden states [B,S,D], cross K/V cache)."""

    def step(
        self,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        self_attention_mask: np.ndarray,
        encoder_attention_mask: np.ndarray,
        past: Cache,
        cross: Cache,
        need_logits: bool = True,
    ) -> StepOutput:
        """One decoder call: logits float32 [B,T,V] as numpy (None when need_logits is
        False: the search decides from the top candidates), the present cache, and each
        position's top candidates where the backend has them."""

    def empty_past(self, rows: int) -> Cache:
        """A self-attention cache of length 0 for `rows` rows."""

    def take_rows(self, cache: Cache, index: np.ndarray, reuse: bool = False) -> Cache:
        """Rows `index` of every tensor (axis 0): reorder, duplicate or drop rows.

        reuse: the caller hands `cache` over, so its storage may be rewritten in place.
        """

    def concat_rows(self, caches: Sequence[Cache], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> Cache:
        """Rows of several caches stacked (axis 0). Their time axes (2) must agree, unless
        `length` is given: then each is zero-padded to it on the left or on the right (in the
        same pass, where the backend can). first_rows: only these rows of the first cache,
        in this order; first_time: only positions [start, stop) of its time axis (both
        taken in the same pass, where the backend can)."""

    def pad_time(self, cache: Cache, length: int, left: bool) -> Cache:
        """Zero-pad the time axis (2) to `length`, on the left or on the right."""

    def slice_time(self, cache: Cache, start: int, stop: int) -> Cache:
        """Keep positions [start, stop) of the time axis (2)."""


def banned_tokens(backend: Backend) -> np.ndarray | None:
    """The token ids [n] no search may produce on `backend`, None for none: its
    `banned_token_ids`, or, where it has none, the pad token unless it is also eos (the rule
    of tfserve.artifacts.generation_defaults.pad_ban, for a manifest written before the field)."""
    banned = getattr(backend, "banned_token_ids", None)
    if banned is None:
        pad = backend.pad_token_id
        banned = (pad,) if pad != backend.eos_token_id else ()
    return np.array(banned, np.int64) if len(banned) else None


class RowCutter(Protocol):
    """The two cache operations `narrow_first` needs (a Backend has them, and so has a
    runtime's cache placement)."""

    def take_rows(self, cache: Cache, index: np.ndarray, reuse: bool = False) -> Cache: ...

    def slice_time(self, cache: Cache, start: int, stop: int) -> Cache: ...


def narrow_first(backend: RowCutter, caches: Sequence[Cache], first_rows: np.ndarray | None,
                 first_time: tuple[int, int] | None) -> list[Cache]:
    """`caches` with the first one cut to `first_time` and `first_rows` by separate copies:
    `Backend.concat_rows` for a backend (or a case) that cannot take them in its own pass."""
    first = caches[0]
    if first_time is not None:
        first = backend.slice_time(first, *first_time)
    if first_rows is not None:
        first = backend.take_rows(first, first_rows)
    return [first, *caches[1:]]
