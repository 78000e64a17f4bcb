"""Greedy search: each step keeps the single most likely token."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.generation.search import GroupDecision, Search, register_search


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
        values = self.block_eos_candidates(ids, log_probs)[0]
        best = int(values.argmax())  # the first of equal maxima, as argmax over the row
        return self._choose(int(ids[0, best]), float(values[best]))

    def group_key(self) -> Hashable | None:
        if self.controls is not None or self.forcing or self.ending:
            return None
        return ("greedy", self.eos)

    @classmethod
    def decide_group(cls, searches: Sequence[Search], ids: np.ndarray, log_probs: np.ndarray
                     ) -> GroupDecision:
        """advance_candidates of one-row searches at once: ids, log_probs [M,K]."""
        count = len(searches)
        eos = searches[0].eos
        blocked = [s.generated < s.options.min_new_tokens for s in searches]
        values = log_probs
        if any(blocked):  # eos not allowed yet
            values = np.where(np.array(blocked)[:, None] & (ids == eos), -np.inf,
                              log_probs)  # [M,K]
        rows = np.arange(count)
        best = values.argmax(axis=1)  # [M]: the first of equal maxima, as advance_candidates
        tokens, scores = ids[rows, best], values[rows, best]  # [M], [M]
        return GroupDecision(rows, tokens, list(range(count + 1)),
                             (tokens.tolist(), scores.tolist()))

    def take_decision(self, decision: GroupDecision, index: int) -> None:
        tokens, scores = decision.detail
        self._take(tokens[index], scores[index])

    def _force(self) -> tuple[np.ndarray, np.ndarray]:
        """A prefix token, log-probability 0 (next_forced counts it where it is new)."""
        return self._choose(self.next_forced(), 0.0, decided=False)

    def _choose(self, token: int, log_prob: float, decided: bool = True
                ) -> tuple[np.ndarray, np.ndarray]:
        """`_take`, with the next row as `advance` returns it."""
        if self._take(token, log_prob, decided):
            return np.zeros(1, np.int64), np.array([token], np.int64)
        return np.zeros(0, np.int64), np.zeros(0, np.int64)

    def _take(self, token: int, log_prob: float, decided: bool = True) -> bool:
        """Append `token`; decided: a token of the search's own choice (a new token).
        Returns whether the search goes on (its row continues with `token`)."""
        self.score += log_prob
        if decided:
            self.generated += 1
        if token == self.eos:
            self.finished.append(Hypothesis(list(self.tokens), self.score))
            self.done, self.streamed = True, []
            return False
        self.tokens.append(token)
        self.streamed = [token]
        if self.generated >= self.options.max_new_tokens:
            self.finished.append(Hypothesis(list(self.tokens), self.score, finished=False))
            self.done = True
            return False
        return True
