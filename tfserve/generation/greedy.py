"""Greedy search: each step keeps the single most likely token."""

from __future__ import annotations

import numpy as np

from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.generation.search import Search, register_search


@register_search("greedy", lambda options: not options.do_sample and options.num_beams <= 1)
class GreedySearch(Search):
    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        super().__init__(options, eos_token_id, start_token_id)
        self.tokens: list[int] = []
        self.score = 0.0

    def top_needed(self) -> int:
        return self.needs(1)

    def histories(self) -> np.ndarray:
        return np.array([[self.start, *self.tokens]], np.int64)  # [1,L]

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.ending:
            return self._choose(self.eos, 0.0)  # the forced eos: log-probability 0
        if self.forcing:
            return self._force()
        if self.controls is None:
            row = self.block_eos(logits)[0]
            token = int(row.argmax())
            return self._choose(token, float(row[token] - lse[0]))
        # as transformers' greedy search: the controls act on the logits
        history = self.histories()
        row = self.block_eos(self.controls.apply(logits[:1], history))[0]
        token = int(row.argmax())
        log_prob = self.controls.log_probs(logits[:1, token] - lse[:1], np.array([token]),
                                           history)
        return self._choose(token, float(log_prob[0]))

    def advance_candidates(self, ids: np.ndarray, log_probs: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        if self.ending:
            return self._choose(self.eos, 0.0)
        if self.forcing:
            return self._force()
        values = log_probs[0]
        if self.generated < self.options.min_new_tokens:
            values = np.where(ids[0] == self.eos, -np.inf, values)
        best = int(values.argmax())  # the first of equal maxima, as argmax over the row
        return self._choose(int(ids[0, best]), float(values[best]))

    def _force(self) -> tuple[np.ndarray, np.ndarray]:
        """A prefix token, log-probability 0 (next_forced counts it where it is new)."""
        return self._choose(self.next_forced(), 0.0, decided=False)

    def _choose(self, token: int, log_prob: float, decided: bool = True
                ) -> tuple[np.ndarray, np.ndarray]:
        """Append `token`; decided: a token of the search's own choice (a new token)."""
        self.score += log_prob
        if decided:
            self.generated += 1
        if token == self.eos:
            self.finished.append(Hypothesis(list(self.tokens), self.score))
            self.done, self.streamed = True, []
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.tokens.append(token)
        self.streamed = [token]
        if self.generated >= self.options.max_new_tokens:
            self.finished.append(Hypothesis(list(self.tokens), self.score, finished=False))
            self.done = True
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.zeros(1, np.int64), np.array([token], np.int64)
