"""A small numpy Backend with deterministic logits, for scheduler and batch tests.

It needs no exported model and runs in microseconds. Each row's logits depend only on that
row's own state (its source, its position and its last token), as a real model's do, so an
answer must not change with whatever else shares the batch: the property continuous
batching has to keep. `FaultyBackend` raises at chosen calls, to test that every request
still ends with exactly one answer or error. `TopCandidatesBackend` also gives each row's best
K candidates, as exported graphs do, so that the searches decide from them.

The answer for a source is a token sequence set by the source: `length(source)` tokens,
then eos, where length = source[0] % 7 + 1; beams and samples see a spread of scores around
that token, so their searches have real choices to make.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tfserve.generation import Cache, StepOutput, narrow_first

PAD, EOS, VOCAB = 0, 1, 16


class FakeBackend:
    """The Backend protocol over numpy arrays: the cross "K/V" is the source ids as floats
    [B,1,S,1]; the self-attention cache holds the tokens fed so far [B,1,P,1]."""

    vocab_size = VOCAB
    eos_token_id = EOS
    pad_token_id = PAD
    decoder_start_token_id = PAD
    grouped_cross = False

    def __init__(self, max_target_positions: int = 64) -> None:
        self.max_target_positions = max_target_positions
        self.calls = 0

    # -- model ----------------------------------------------------------------------------

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[Any, Cache]:
        self._call("encode")
        hidden = (input_ids * attention_mask).astype(np.float32)[:, :, None]  # [B,S,1]
        cross = hidden[:, None, :, :].copy()  # [B,1,S,1]
        return hidden, [cross]

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray,
             self_attention_mask: np.ndarray, encoder_attention_mask: np.ndarray,
             past: Cache, cross: Cache) -> StepOutput:
        self._call("step")
        rows = input_ids.shape[0]
        assert cross[0].shape[0] == rows, "one cross row per decoder row"
        assert self_attention_mask.shape == (rows, past[0].shape[2] + 1)
        source = cross[0][:, 0, :, 0] * encoder_attention_mask  # [R,S]
        first = source[:, 0].astype(np.int64)  # [R]
        total = source.sum(axis=1).astype(np.int64)  # [R]
        position = position_ids[:, 0]  # [R]
        length = first % 7 + 1
        # the token this row "wants" next: a function of its source and position only
        wanted = np.where(position >= length, EOS, 2 + (total + position) % (VOCAB - 2))
        # a score spread that depends on the last token too, so beams differ
        spread = (np.arange(VOCAB)[None, :] * (1 + input_ids[:, :1] % 3)) % 5  # [R,V]
        logits = -1.5 * spread.astype(np.float32)
        logits[np.arange(rows), wanted] = 4.0
        present = [np.concatenate([past[0], input_ids[:, None, :, None].astype(np.float32)],
                                  axis=2)]  # [R,1,P+1,1]
        return StepOutput(logits[:, None, :], present)  # logits [R,1,V]

    # -- cache rows -------------------------------------------------------------------------

    def empty_past(self, rows: int) -> Cache:
        self._call("empty_past")
        return [np.zeros((rows, 1, 0, 1), np.float32)]

    def take_rows(self, cache: Cache, index: np.ndarray, reuse: bool = False) -> Cache:
        self._call("take_rows")
        return [tensor[index] for tensor in cache]

    def concat_rows(self, caches: Sequence[Cache], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> Cache:
        self._call("concat_rows")
        caches = narrow_first(self, caches, first_rows, first_time)
        if length is not None:
            caches = [self.pad_time(cache, length, left) for cache in caches]
        return [np.concatenate([cache[i] for cache in caches]) for i in range(len(caches[0]))]

    def pad_time(self, cache: Cache, length: int, left: bool) -> Cache:
        self._call("pad_time")
        out = []
        for tensor in cache:
            missing = length - tensor.shape[2]
            widths = [(0, 0), (0, 0), (missing, 0) if left else (0, missing), (0, 0)]
            out.append(np.pad(tensor, widths))
        return out

    def slice_time(self, cache: Cache, start: int, stop: int) -> Cache:
        self._call("slice_time")
        return [tensor[:, :, start:stop] for tensor in cache]

    def _call(self, name: str) -> None:
        self.calls += 1


class TopCandidatesBackend(FakeBackend):
    """FakeBackend that also gives each row's best K log-probabilities and their ids
    (`top_log_probs`, `top_ids` [R,1,K], best first), as a graph of revision 2 does.

    ties False: a small row-local term (of the row's last token and position) makes the
    scores distinct; True: FakeBackend's logits as they are, where many tokens share a
    score, so that the searches' tie rule decides. banned_token_ids: the backend's bans
    (None: pad, as `banned_tokens` reads a backend without them).
    """

    def __init__(self, top_candidates: int = 8, ties: bool = False,
                 banned_token_ids: tuple[int, ...] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.top_candidates = top_candidates
        self.ties = ties
        if banned_token_ids is not None:
            self.banned_token_ids = banned_token_ids

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray,
             self_attention_mask: np.ndarray, encoder_attention_mask: np.ndarray,
             past: Cache, cross: Cache, need_logits: bool = True) -> StepOutput:
        out = super().step(input_ids, position_ids, self_attention_mask,
                           encoder_attention_mask, past, cross)
        logits = out.logits[:, 0, :]  # [R,V]
        if not self.ties:
            phase = input_ids[:, :1] * 0.7 + position_ids[:, :1] * 0.11  # [R,1]
            logits = logits + (0.05 * np.sin(np.arange(VOCAB) * 1.3 + phase)).astype(np.float32)
        peak = logits.max(axis=1, keepdims=True)  # [R,1]
        log_probs = logits - (peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True)))
        # best first; equal scores in descending id order, which the searches must not rely on
        order = np.argsort(-log_probs[:, ::-1], axis=1, kind="stable")[:, : self.top_candidates]
        ids = VOCAB - 1 - order  # [R,K]
        top = np.take_along_axis(log_probs, ids, axis=1).astype(np.float32)  # [R,K]
        return StepOutput(logits[:, None, :] if need_logits else None, out.present,
                          top[:, None, :], ids[:, None, :])


class InjectedFault(RuntimeError):
    """The failure FaultyBackend raises."""


class FaultyBackend(FakeBackend):
    """FakeBackend that raises InjectedFault at the calls numbered in `fail_at` (counting
    every backend call from 1), or at every call of the operations in `fail_ops`."""

    def __init__(self, fail_at: set[int] | None = None, fail_ops: set[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_at = set(fail_at or ())
        self.fail_ops = set(fail_ops or ())
        self.faults: list[tuple[int, str]] = []

    def _call(self, name: str) -> None:
        super()._call(name)
        if self.calls in self.fail_at or name in self.fail_ops:
            self.faults.append((self.calls, name))
            raise InjectedFault(f"injected fault at call {self.calls} ({name})")
