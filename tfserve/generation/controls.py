"""Repetition controls over a search's rows: repetition_penalty and no_repeat_ngram_size.

They follow transformers' RepetitionPenaltyLogitsProcessor and NoRepeatNGramLogitsProcessor
on the decoder sequence, which for an encoder-decoder model is the start token, the prefix
and the tokens generated so far (not the source). A search that uses them decides from the
full distribution: it asks the batch for whole logits rows (`Search.top_needed` 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfserve.generation.options import DecodingOptions


@dataclass(frozen=True)
class RepetitionControls:
    """The repetition options of one search, applied to rows of scores [R,V]."""

    penalty: float  # 1.0: no penalty
    ngram_size: int  # 0: no n-gram ban

    @classmethod
    def of(cls, options: DecodingOptions) -> RepetitionControls | None:
        """The controls these options ask for; None when both are off (the fast path)."""
        if options.repetition_penalty == 1.0 and not options.no_repeat_ngram_size:
            return None
        return cls(float(options.repetition_penalty), int(options.no_repeat_ngram_size))

    def apply(self, scores: np.ndarray, history: np.ndarray) -> np.ndarray:
        """A copy of float32 scores [R,V] (logits or log-probabilities) with the controls
        applied; history [R,L] int64: each row's decoder sequence, start token first.

        Every token of a row's history gets its score divided by the penalty where positive
        and multiplied by it where negative (once, however often it occurs); every token that
        would complete an n-gram already in the history becomes -inf.
        """
        scores = scores.copy()
        if self.penalty != 1.0:
            scores[np.arange(len(history))[:, None], history] = self.penalise(
                np.take_along_axis(scores, history, axis=1))  # [R,L], repeats written alike
        if self.ngram_size:
            rows, tokens = banned_ngram_tokens(history, self.ngram_size)
            scores[rows, tokens] = -np.inf
        return scores

    def penalise(self, scores: np.ndarray) -> np.ndarray:
        """transformers' penalty on float32 scores: x / penalty where x >= 0, else x * penalty
        (in float32, as torch computes it with a Python float)."""
        return np.where(scores < 0, scores * self.penalty, scores / self.penalty)

    def log_probs(self, log_probs: np.ndarray, tokens: np.ndarray, history: np.ndarray
                  ) -> np.ndarray:
        """The scores of chosen tokens [R] from their float32 model log-probabilities [R]:
        penalised where the token is in its row's history [R,L] (what transformers' beam
        search adds up; greedy search and sampling report the same)."""
        if self.penalty == 1.0:
            return log_probs
        seen = (history == tokens[:, None]).any(axis=1)  # [R]
        return np.where(seen, self.penalise(log_probs), log_probs)


def banned_ngram_tokens(history: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, tokens) that would repeat an n-gram of `size` in history [R,L].

    The last size-1 tokens of a row are matched against every complete n-gram of that row;
    each match bans the n-gram's last token (for size 1: every token of the row).
    """
    rows, length = history.shape
    if length < size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(history, size, axis=1)  # [R,W,n]
    tail = history[:, length - size + 1:]  # [R,n-1]
    matches = (windows[:, :, :-1] == tail[:, None, :]).all(axis=2)  # [R,W]
    row_index, window_index = np.nonzero(matches)
    return row_index, windows[row_index, window_index, -1]
