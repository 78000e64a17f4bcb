"""Sampling: independent samples from the tempered, filtered distribution."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tfserve.generation.kernels import filter_logits, log_softmax
from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.generation.search import Search, register_search
from tfserve.step import SampleDraws


@register_search("sampling", lambda options: bool(options.do_sample))
class SamplingSearch(Search):
    """num_return_sequences independent samples from the tempered, filtered distribution.

    Each search owns its random generator, seeded from the request, so the same seed gives
    the same output whatever else shares the batch. The samples fan out after the prefix;
    repetition controls act on the logits, before temperature and filters (as in
    transformers); a forced eos ends every sample at max_new_tokens.

    A step draws one of three ways, all with the same uniform per sample (so a seed gives
    the same samples on each): from the candidates (`advance_candidates`, top-k within
    the backend's top candidates), from whole numpy rows (`advance`), or, where the backend
    draws where its logits are (a device), from the tokens it drew as `device_draw` asked
    (`advance_drawn`). The three share the fan-out and the bookkeeping of a drawn token
    (`_extend`: eos, max_new_tokens, streaming).
    """

    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        super().__init__(options, eos_token_id, start_token_id)
        seed = options.seed if options.seed is not None else int(np.random.SeedSequence().entropy
                                                                 % 2**63)
        self.rng = np.random.default_rng(seed)
        self.samples: list[list[int]] = [[]]
        self.scores: list[float] = [0.0]
        self.fanned_out = False  # the single start row became the samples

    def histories(self) -> np.ndarray:
        return np.array([[self.start, *sample] for sample in self.samples], np.int64)

    def top_needed(self) -> int:
        """Top-k sampling (0 < top_k) draws among the k most likely tokens, so the k best
        per row (eos and banned ids beside them) decide it as the whole row would: the
        temperature and top-p act on those k alone. Without top-k every token may be drawn:
        whole rows, or the backend's draw (`device_draw`)."""
        if self.forcing or self.ending:
            return 1
        return self.needs(self.options.top_k) if self.options.top_k > 0 else 0

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.ending:
            return self._end()
        if self.forcing:
            return self._force()
        model_logits = logits
        logits = self.block_eos(logits)
        history = None
        if self.controls is not None:
            history = self.histories()  # [rows,L]
            logits = self.controls.apply(logits, history)

        def log_prob(parent: int, column: int) -> float:
            value = model_logits[parent, column] - lse[parent]
            if history is not None:
                value = self.controls.log_probs(  # type: ignore[union-attr]
                    np.array([value]), np.array([column]), history[parent : parent + 1])[0]
            return float(value)

        return self._draw(logits, None, log_prob)

    def advance_candidates(self, ids: np.ndarray, log_probs: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        """`advance` from each row's best tokens (top_needed: top_k of them, besides eos and
        the banned ids): ids [rows,K], log_probs [rows,K] (banned -inf). The draw runs over
        the candidates in token id order, as `advance`'s runs over a whole row, and takes the
        same uniform, so a seed gives the same samples either way."""
        if self.ending:
            return self._end()
        if self.forcing:
            return self._force()
        log_probs = self.block_eos_candidates(ids, log_probs)
        order = np.argsort(ids, axis=1, kind="stable")  # [rows,K]: increasing token ids
        ids = np.take_along_axis(ids, order, axis=1)
        log_probs = np.take_along_axis(log_probs, order, axis=1)
        return self._draw(log_probs, ids, lambda parent, column: float(log_probs[parent, column]))

    def device_draw(self) -> SampleDraws | None:
        """The whole-row draw of `advance` (no repetition controls), made by the backend
        where the logits are: per sample its parent row, the uniform `_draw` would take
        next (peeked: the generator moves in `advance_drawn`), and the options."""
        if self.forcing or self.ending or self.controls is not None:
            return None
        parents = self._parents()
        state = self.rng.bit_generator.state
        uniforms = self.rng.random(len(parents))  # [S]: one per sample, in sample order
        self.rng.bit_generator.state = state
        options, count = self.options, len(parents)
        return SampleDraws(parents, uniforms, np.full(count, options.temperature, np.float32),
                           np.full(count, options.top_k, np.int64),
                           np.full(count, options.top_p, np.float32),
                           np.full(count, self.generated < options.min_new_tokens),
                           self.eos)

    def advance_drawn(self, tokens: np.ndarray, log_probs: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
        parents = self._fan_out()
        self.rng.random(len(parents))  # the uniforms the draws took (device_draw's)
        return self._extend(parents, tokens.tolist(), log_probs.tolist())

    def _parents(self) -> np.ndarray:
        """The row each sample of this step continues [S]: the single start row for every
        sample before the fan-out, then each sample its own."""
        if not self.fanned_out:
            return np.zeros(self.options.num_return_sequences, np.int64)
        return np.arange(self.rows, dtype=np.int64)

    def _fan_out(self) -> np.ndarray:
        """`_parents`, the samples made from the single start row where this is the first
        draw."""
        parents = self._parents()
        if not self.fanned_out:
            self.samples = [list(self.samples[0]) for _ in parents]
            self.scores = [self.scores[0]] * len(parents)
            self.fanned_out = True
        return parents

    def _draw(self, logits: np.ndarray, ids: np.ndarray | None,
              log_prob: Callable[[int, int], float]) -> tuple[np.ndarray, np.ndarray]:
        """One token per sample from `logits` [rows,C] (a whole row of the vocabulary, or
        the candidates `ids` [rows,C] in increasing id order; a log-softmax shift changes
        nothing here) after temperature, top-k and top-p; log_prob(parent, column) is the
        score the drawn token adds. A backend that takes draws in its step makes this same
        draw where the logits are (`device_draw`, `SampleDraws`)."""
        parents = self._fan_out()
        scaled = logits[parents] / self.options.temperature  # [S,C]; banned stay -inf
        probs = np.exp(log_softmax(filter_logits(scaled, self.options.top_k, self.options.top_p)))
        tokens, log_probs = [], []
        for slot, parent in enumerate(parents):
            # inverse-CDF draw: one uniform per row keeps the stream reproducible
            cdf = np.cumsum(probs[slot], dtype=np.float64)
            column = int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"),
                             len(cdf) - 1))
            while probs[slot, column] == 0.0:  # never land on a filtered-out token
                column -= 1
            tokens.append(column if ids is None else int(ids[parent, column]))
            log_probs.append(log_prob(int(parent), column))
        return self._extend(parents, tokens, log_probs)

    def _extend(self, parents: np.ndarray, tokens: list[int], log_probs: list[float]
                ) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's drawn token and the log-probability it adds (parents [S]: the row
        it continues): a sample that draws eos, or reaches max_new_tokens, finishes; ->
        the parents and tokens of those that go on."""
        self.generated += 1
        keep_parents, keep_tokens, keep_samples, keep_scores = [], [], [], []
        for slot, parent in enumerate(parents):
            token, score = tokens[slot], self.scores[slot] + log_probs[slot]
            sample = self.samples[slot]
            if token == self.eos:
                self.finished.append(Hypothesis(list(sample), score))
            elif self.generated >= self.options.max_new_tokens:
                self.finished.append(Hypothesis(sample + [token], score, finished=False))
            else:
                keep_parents.append(parent)
                keep_tokens.append(token)
                keep_samples.append(sample + [token])
                keep_scores.append(score)
        self.samples, self.scores = keep_samples, keep_scores
        self.streamed = keep_tokens if self.options.num_return_sequences == 1 else []
        self.done = not keep_parents
        return np.array(keep_parents, np.int64), np.array(keep_tokens, np.int64)

    def _force(self) -> tuple[np.ndarray, np.ndarray]:
        """A prefix token for the single row, log-probability 0 (next_forced counts it
        where it is new); at max_new_tokens every sample is the prefix so far."""
        token = self.next_forced()
        tokens = self.samples[0]
        tokens.append(token)
        self.streamed = [token] if self.options.num_return_sequences == 1 else []
        if self.generated >= self.options.max_new_tokens:
            self.finished.extend(Hypothesis(list(tokens), self.scores[0], finished=False)
                                 for _ in range(self.options.num_return_sequences))
            self.done = True
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.zeros(1, np.int64), np.array([token], np.int64)

    def _end(self) -> tuple[np.ndarray, np.ndarray]:
        """The forced eos for every sample, log-probability 0 (transformers samples from a
        distribution that holds eos alone); before the fan-out, the samples are the single
        row so far."""
        self.generated += 1
        count = len(self.samples) if self.fanned_out else self.options.num_return_sequences
        self.finished.extend(Hypothesis(list(self.samples[i if self.fanned_out else 0]),
                                        self.scores[i if self.fanned_out else 0])
                             for i in range(count))
        self.samples, self.scores, self.streamed = [], [], []
        self.done = True
        return np.zeros(0, np.int64), np.zeros(0, np.int64)

    def results(self) -> list[Hypothesis]:
        return list(self.finished)  # samples in the order they finished; scores are not ranks
