"""The step contract: what a search asks of one decoder step, and what the step gives back.

`tfserve.generation` (the searches and `DecodeBatch`) asks; a backend answers: the ONNX
Runtime sessions of `tfserve.runtime`, with their cache placements (host numpy, device
OrtValues, the static buffers), or the eager PyTorch model of `tfserve.model.eager`. Both
sides import this module and nothing of each other: the search never names a placement, a
cache storage, an ONNX graph or a feed, and the runtime never imports a search.

A step is given, per decoder row, its token id and position (`input_ids`, `position_ids`
[B,1]), the masks, the opaque past and cross caches, and two optional requests:

- `parents` [B]: row i continues row `parents[i]` of `past` (a beam step's reorder, left to
  the next step). Only a backend that says it `reorders_in_step` is given them by the batch
  (any backend may be: the runtime's placements all honour them, each its own way: a Gather
  inside the step's run, a numpy gather, index bookkeeping).
- `draws` (`SampleDraws`): tokens to draw from whole rows of the step's logits where the
  backend makes them, so that no row of vocabulary size crosses to the host. Only a backend
  that says it `draws_in_step` is given them.

It returns a `StepOutput`: the top candidates (where the backend computes them), the drawn
tokens (where draws were asked for), and the whole [B,T,V] logits only when asked for them
(`need_logits`). Imports numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

Cache = Any  # a backend's per-layer tensors; the search code never looks inside


class SampleDraws(NamedTuple):
    """Tokens to draw from whole rows of a step's logits where the backend made them, as
    `SamplingSearch` draws from numpy rows: one token per entry, each with its own row,
    uniform and options (a sampling member's DecodingOptions as the step sees them). A
    search's `device_draw` gives its part (rows among its own, no bans); DecodeBatch joins
    the parts (rows of the batch, the backend's bans)."""

    rows: np.ndarray  # [S] int64: the row each draw reads
    uniforms: np.ndarray  # [S] float64 in [0,1): each draw's uniform (inverse-CDF draw)
    temperature: np.ndarray  # [S] float32
    top_k: np.ndarray  # [S] int64 (0: off)
    top_p: np.ndarray  # [S] float32 (1: off)
    block_eos: np.ndarray  # [S] bool: eos may not be drawn (min_new_tokens not reached)
    eos_token_id: int
    banned: np.ndarray | None = None  # [n] int64: ids no draw lands on (None: none)


class StepOutput(NamedTuple):
    """One decoder call, as the search sees it."""

    logits: np.ndarray | None  # float32 [B,T,V]; None where the step was asked for none
    present: Cache
    # where the backend computes them (graph revision 2): each position's best
    # log-probabilities [B,T,K], best first, and their token ids [B,T,K]
    top_log_probs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    # where the step was given `draws`: the drawn token ids [S] int64 and their
    # log-probabilities [S] (logit - logsumexp of the unscaled row), draw by draw
    drawn_ids: np.ndarray | None = None
    drawn_log_probs: np.ndarray | None = None


class Backend(Protocol):
    """What the search needs from a model: an encoder, one decoder step, cache row ops."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    # optional, not declared here: `banned_token_ids`, the tokens no search produces on it
    # (the checkpoint's bans, model.json's); without it pad is banned unless it is eos
    # (`generation.banned_tokens`)
    # step accepts cross K/V and encoder mask with B/G rows, row r using row r // G
    grouped_cross: bool
    decoder_start_token_id: int
    max_target_positions: int
    # K: the best candidates per position that every step gives (top_log_probs, top_ids),
    # 0 where it gives none. A backend with K > 0 takes need_logits=False in `step`
    # (optional: a backend without top candidates is never asked)
    top_candidates: int
    # optional (False where absent): `step` takes `parents` and honours them for less than
    # a `take_rows` before it (the batch then leaves a beam step's reorder to the next step)
    reorders_in_step: bool
    # optional (False where absent): `step` takes `draws` and makes them where the logits are
    draws_in_step: bool

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
        parents: np.ndarray | None = None,
        draws: SampleDraws | None = None,
    ) -> StepOutput:
        """One decoder call: logits float32 [B,T,V] as numpy (None when need_logits is
        False: the search decides from the top candidates or the draws), the present cache,
        each position's top candidates where the backend has them, and the tokens of
        `draws` where given. parents [B]: row i continues row parents[i] of `past` (None:
        its own row; `reorders_in_step`)."""

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
